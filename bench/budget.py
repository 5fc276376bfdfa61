"""Budget precision: how closely N replicas together hold one scope's shared rate budget.

For each (replicas, budget) pair: a fresh database holding more due items than the budget
can drain in the measured period; a fake upstream in its own process that answers 429 above
its limit (`--upstream window`, the default: more than budget + burst calls in any trailing
second, the issue's condition for zero 429s, "the budget equals the upstream's limit minus
burst"; `--upstream bucket`: a token bucket at the budget itself); N `sweeper worker` OS
processes sharing the scope's bucket in
PostgreSQL. Items are released once every process is connected, and the upstream's own
arrival log is read after `--seconds` of calls. Reported per repetition and as medians:

  achieved_percent   calls answered 2xx in the measured period / what the budget allows
                     in it (burst + budget x seconds), from the first call on
  worst_window       most calls in any 1-second window, and the same over (rate + burst)
  throttled          429s the upstream sent (the target is zero)
  unused_percent     budget lost because the bucket sat full with no call ready
  worker_counters    tokens granted and returned, leases handed back by reason
  startup_seconds    from the release to the first call (both on this machine's monotonic
                     clock, which every process shares)

With `--wire`, tcpdump also records when each request reached the loopback interface (the
kernel's clock, whatever the upstream process's own scheduling), and the same figures are
computed from those times: `wire.worst_window`, `wire.over_limit` (the calls an upstream
stamping arrivals on time would have refused: more than rate + burst in the trailing
second), and `wire.stamp_lag_ms`, how much later the fake upstream stamped the k-th call
than the k-th request reached it. An overshoot on the wire is Sweeper's; one only in the
fake's stamps is the measurement's (the upstream process starved of CPU).

    python -m bench budget --replicas 1,2,4 --budgets 10,100,1000 --seconds 60 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.ext.asyncio import AsyncEngine

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
from drills.stage import free_port, trailing_counts, worst_window
from service.budget.rules import LOOKAHEAD_S
from service.config.policies import load_policies
from service.ledger import registration
from service.runs import publication, trigger

SCOPE_TENANT = "acme"
REGISTER_CHUNK = 10_000
# With `--upstream bucket` the upstream is a token bucket at exactly the budget, with a
# little more burst than Sweeper's bucket holds.
BUCKET_EXTRA_BURST = 2
WORKER_COUNTERS = frozenset({
    "sweeper_limiter_tokens_granted_total", "sweeper_limiter_tokens_returned_total",
    "sweeper_limiter_waits_total", "sweeper_leases_returned_total",
    "sweeper_items_claimed_total"})

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
    parser.add_argument("--upstream", choices=("window", "bucket"), default="window",
                        help="the upstream's limit: `window`, at most budget + burst calls in "
                             "any trailing second (default); `bucket`, a token bucket at the "
                             "budget with burst + 2")
    parser.add_argument("--wire", action="store_true",
                        help="also time the requests on the loopback interface with tcpdump "
                             "(needs tcpdump and the right to capture)")
    parser.add_argument("--burst-fraction", type=float, default=0.05,
                        help="Sweeper's burst as a fraction of the rate, at least 1 "
                             "(default 0.05)")


def unused_budget(times: list[float], start: float, end: float, rate: float, burst: int
                  ) -> float:
    """Tokens a bucket of (rate, burst), full at `start`, lost to its cap between `start`
    and `end` with calls at `times`: budget that went unspent because no call was ready
    while the bucket was full. (What the bucket owes but was not yet spent at `end` is not
    lost; achieved + unused + owed = allowed.)"""
    tokens, last, lost = float(burst), start, 0.0
    for t in [*sorted(times), end]:
        refill = tokens + rate * (t - last)
        lost += max(0.0, refill - burst)
        tokens, last = min(float(burst), refill) - (1 if t < end else 0), t
    return lost


async def worker_counters(ports: list[int]) -> dict[str, float]:
    """The limiter and hand-back counters of the worker processes, summed."""
    totals: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=5) as client:
        for port in ports:
            try:
                body = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
            except httpx.HTTPError:
                continue  # a worker that died is visible in its log, not here
            for family in text_string_to_metric_families(body):
                for sample in family.samples:
                    if sample.name not in WORKER_COUNTERS:
                        continue
                    reason = sample.labels.get("reason")
                    key = sample.name.removeprefix("sweeper_").removesuffix("_total")
                    key = f"{key}:{reason}" if reason else key
                    totals[key] = totals.get(key, 0.0) + sample.value
    return totals


@contextlib.asynccontextmanager
async def wire_capture(port: int, out: Path) -> AsyncIterator[None]:
    """tcpdump on loopback, writing one line per TCP segment carrying data to `port` (each
    HTTP request is one), stamped by the kernel (-tt: seconds since the epoch)."""
    tcpdump = shutil.which("tcpdump")
    if tcpdump is None:
        raise RuntimeError("--wire needs tcpdump (apt-get install tcpdump)")
    with out.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            tcpdump, "-i", "lo", "-n", "-tt", "-l", "-q", "-s", "96",
            f"tcp dst port {port} and (tcp[tcpflags] & tcp-push != 0)",
            stdout=sink, stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stderr is not None
        said = b""
        while b"listening on" not in said:  # its last line before it captures
            line = await asyncio.wait_for(proc.stderr.readline(), 10)
            if not line:
                raise RuntimeError(f"tcpdump did not start: {said.decode(errors='replace')}")
            said += line
        yield
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()


def wire_figures(out: Path, stamps: list[float], seconds: float, limit: int
                 ) -> dict[str, Any]:
    """The measured period on the wire: from the first request, `seconds` long. `stamps`
    are the fake upstream's own wall-clock stamps of the calls, for the lag."""
    wire = sorted(float(line.split()[0]) for line in out.read_text().splitlines()
                  if line[:1].isdigit())
    if not wire:
        raise RuntimeError("tcpdump saw no request")
    period = [t for t in wire if t < wire[0] + seconds]
    # each request beyond `limit` in its trailing second
    over = sum(count > limit for count in trailing_counts(period))
    lags = sorted(1000 * (s - w) for s, w in zip(sorted(stamps), wire, strict=False))
    return {"requests": len(period), "worst_window": worst_window(period),
            "over_limit": over,
            "stamp_lag_ms": {"p50": round(lags[len(lags) // 2], 2),
                             "p99": round(lags[int(len(lags) * 0.99)], 2),
                             "max": round(lags[-1], 2)}}


SLOT_SECONDS = LOOKAHEAD_S + 0.05


def concurrency_for(budget: int, replicas: int) -> int:
    """Workers per process: a call holds its slot from the grant, up to the lookahead
    before its moment, until its answer (~50 ms allowed), so the replicas together need
    budget x SLOT_SECONDS slots. With fewer, the reservations cover less than the
    lookahead, and a stall of the event loop longer than they do lets the bucket fill up
    and lose budget (1,000/s with 40 slots: 2% of it)."""
    return max(4, min(256, math.ceil(budget * SLOT_SECONDS / replicas)))


async def start_worker(url: str, policies_file: Path, workers: int, metrics_port: int = 0,
                       log_path: Path | None = None) -> asyncio.subprocess.Process:
    """`sweeper worker` as its own process; its warnings go to `log_path`, by default a
    file beside the policies (a pipe nobody reads could fill up and stall the worker
    mid-measurement)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
    env.update({"SWEEPER_DATABASE_URL": url, "SWEEPER_POLICIES_FILE": str(policies_file),
                "SWEEPER_WORKERS": str(workers), "SWEEPER_LOG_FORMAT": "json",
                "SWEEPER_LOG_LEVEL": "WARNING", "SWEEPER_MIGRATE_ON_START": "false",
                "SWEEPER_DB_POOL_SIZE": "10", "SWEEPER_METRICS_PORT": str(metrics_port)})
    log_path = log_path or policies_file.parent / f"worker-{secrets.token_hex(4)}.log"
    with log_path.open("wb") as log:
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


@contextlib.asynccontextmanager
async def worker_processes(url: str, policies_file: Path, workers: int, replicas: int,
                           metrics_ports: list[int] | None = None) -> AsyncIterator[None]:
    """`replicas` `sweeper worker` processes on `url`, yielded once all are connected and
    their start-up CPU has settled; SIGTERM (then SIGKILL after 30 s) on the way out."""
    ports = metrics_ports or [0] * replicas
    procs = [await start_worker(url, policies_file, workers, port) for port in ports]
    try:
        deadline = time.monotonic() + 60
        while await connected_workers(url) < replicas:
            if time.monotonic() > deadline:
                raise RuntimeError("worker processes did not connect within 60 s")
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # let their start-up CPU settle
        yield
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


async def release_everything(engine: AsyncEngine) -> None:
    """A run over every due item, published at once."""
    run_id, _ = await trigger.create_run(engine, trigger.RunRequest(None, None, None,
                                                                    False, None),
                                         None)
    await publication.publish(engine, run_id, batch_size=5_000)


def upstream_options(budget: int, burst: int, kind: str) -> list[str]:
    """The fake upstream's limit. `window`: the budget is the upstream's limit minus the
    burst, as the budget issue states its zero-429 target, and the limit is "so many calls
    per second" taken literally (any trailing second), so a 429 means a 1-second window
    over rate + burst. `bucket`: a token bucket at exactly the budget; Sweeper's schedule
    conforms to it, and its two extra tokens of burst absorb the jitter of arrivals."""
    if kind == "window":
        return ["--default-limit", str(budget + burst), "--default-window"]
    return ["--default-limit", str(budget), "--default-burst", str(burst + BUCKET_EXTRA_BURST)]


async def one_configuration(ctx: BenchContext, replicas: int, budget: int, seconds: float,
                            burst_fraction: float, upstream: str, wire: bool = False
                            ) -> dict[str, Any]:
    burst = max(1, round(budget * burst_fraction))
    items = math.ceil(budget * (seconds + 10) * 1.2)
    limit = upstream_options(budget, burst, upstream)
    async with (fake_upstream_process(ctx.repo_root, *limit) as (base_url, _pid),
                fresh_database(ctx.server_url, "budget") as db):
        with tempfile.TemporaryDirectory(prefix="sweeper-bench-budget-") as tmp:
            capture = Path(tmp) / "wire.txt"
            port = int(base_url.rsplit(":", 1)[1])
            capturing = (wire_capture(port, capture) if wire
                         else contextlib.nullcontext())
            policies_file = Path(tmp) / "policies.toml"
            policies_file.write_text(POLICIES.format(base_url=base_url, rate=budget,
                                                     burst=burst))
            policy = load_policies(policies_file).policies["carts"]
            due = datetime.now(UTC) - timedelta(days=1)
            for start in range(0, items, REGISTER_CHUNK):
                await registration.register(db.engine, [
                    registration.Registration(SCOPE_TENANT, f"cart-{i:08d}", policy, due)
                    for i in range(start, min(items, start + REGISTER_CHUNK))])
            workers = concurrency_for(budget, replicas)
            ports = [free_port() for _ in range(replicas)]
            async with (capturing,
                        worker_processes(db.url, policies_file, workers, replicas, ports)):
                released_at = time.monotonic()
                await release_everything(db.engine)
                publish_s = time.monotonic() - released_at
                await asyncio.sleep(seconds + 2.0 + publish_s)
                counters = await worker_counters(ports)
            async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
                calls = (await client.get("/_control/calls")).json()
            on_wire = wire_figures(capture, [c["wall_time"] for c in calls], seconds,
                                   budget + burst) if wire else None
    if not calls:
        raise RuntimeError("the upstream saw no call")
    t0 = min(c["received_at"] for c in calls)
    window = [c for c in calls if t0 <= c["received_at"] < t0 + seconds]
    ok = [c["received_at"] for c in window if c["outcome"] == "ok"]
    throttled = sum(1 for c in calls if c["outcome"] == "throttled")
    worst = worst_window([c["received_at"] for c in window])
    unused = unused_budget(ok, t0, t0 + seconds, budget, burst)
    allowed = budget * seconds + burst  # a full bucket at the start, then the rate
    return {
        "replicas": replicas, "budget_per_second": budget, "burst": burst,
        "upstream_limit": " ".join(limit),
        "workers_per_process": workers, "items": items, "seconds": seconds,
        "calls_ok": len(ok), "achieved_percent": round(100 * len(ok) / allowed, 2),
        "worst_window": worst, "worst_window_over_rate_plus_burst":
            round(worst / (budget + burst), 4),
        "startup_seconds": round(t0 - released_at, 3),
        "unused_percent": round(100 * unused / allowed, 2), "worker_counters": counters,
        "throttled": throttled, "throttled_first_second": sum(
            1 for c in calls if c["outcome"] == "throttled" and c["received_at"] < t0 + 1),
        **({"wire": on_wire} if on_wire is not None else {}),
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
                                                    args.burst_fraction, args.upstream,
                                                    args.wire))
            results.append({
                "replicas": replicas, "budget_per_second": budget, "runs": reps,
                "achieved_percent": summarize([r["achieved_percent"] for r in reps]),
                "worst_window": summarize([r["worst_window"] for r in reps]),
                "worst_window_over_rate_plus_burst": summarize(
                    [r["worst_window_over_rate_plus_burst"] for r in reps]),
                "throttled": summarize([r["throttled"] for r in reps]),
                **({"wire_worst_window": summarize([r["wire"]["worst_window"] for r in reps]),
                    "wire_over_limit": summarize([r["wire"]["over_limit"] for r in reps])}
                   if args.wire else {}),
            })
            last = results[-1]
            progress(f"budget: {replicas}x{budget}/s achieved "
                     f"{last['achieved_percent']['median']}%, worst window "
                     f"{last['worst_window']['median']}, 429s {last['throttled']['median']}"
                     + (f"; on the wire: worst window {last['wire_worst_window']['median']}, "
                        f"over the limit {last['wire_over_limit']['median']}"
                        if args.wire else ""))
    return {"configurations": results,
            "targets": {"achieved_percent_min": 98, "throttled": 0,
                        "worst_window_max": "rate + burst"}}


BENCHMARK = Benchmark("budget", "shared rate budget precision across replicas",
                      add_arguments, run)

"""Drills where the network is slow rather than cut: PostgreSQL further away (latency with
jitter through the drill's fault proxy) and an upstream answering five times slower. Judged
by drills/history.py like the partitions."""

from __future__ import annotations

import asyncio
import time

import httpx

from drills.base import Drill, Facts, check
from drills.faultproxy import FaultProxy
from drills.history import judge
from drills.links import server, through, worker
from drills.stage import Proc, Stage


async def _late_tokens(procs: list[Proc]) -> int:
    """Leases the workers handed back because their token's moment had passed."""
    total = 0.0
    async with httpx.AsyncClient(timeout=5) as client:
        for proc in procs:
            text = (await client.get(f"http://127.0.0.1:{proc.port}/metrics")).text
            total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("sweeper_leases_returned_total{")
                         and 'reason="late_token"' in line)
    return int(total)


LATENCY_S = (0.04, 0.08)  # added each way: 80-160 ms more per round trip
LATENCY_FOR_S = 30.0
LATENCY_LEASE_S = 10


async def database_latency(stage: Stage) -> Facts:
    """PostgreSQL 80-160 ms further away (latency with jitter, each way) for every process
    for LATENCY_FOR_S, then near again."""
    rate, burst = 50.0, 5
    upstream = stage.start_upstream()
    stage.write_policies(rate=rate, burst=burst, lease=LATENCY_LEASE_S, timeout=3)
    n = 1500
    keys = await stage.register([f"o{i}" for i in range(n)])
    proxy = FaultProxy(*server(stage.db_url))
    direct = stage.db_url
    stage.db_url = await through(stage, proxy)
    stage.cleanups.append(proxy.close)
    workers = [worker(stage, f"w{i}", {}, metrics=True) for i in (1, 2)]
    await stage.wait_started(*workers)
    stage.db_url = direct
    await stage.release()

    async def calling() -> bool:
        return len(upstream.calls()) >= 100

    await stage.wait_for("calls before the latency", calling, 30, 0.05)
    late_before = await _late_tokens(workers)
    proxy.slow(LATENCY_S)
    slowed_at = time.time()
    await asyncio.sleep(LATENCY_FOR_S)
    proxy.slow(None)
    late_while_slow = await _late_tokens(workers) - late_before
    await stage.wait_all_finished(n, 120)
    calls = upstream.calls()
    facts = await judge(stage, calls, keys, rate=rate, burst=burst, lease_s=LATENCY_LEASE_S)
    while_slow = [c for c in calls if slowed_at <= c.wall_time < slowed_at + LATENCY_FOR_S]
    facts.update({"latency_each_way_ms": [int(x * 1000) for x in LATENCY_S],
                  "calls_while_slow_per_s": round(len(while_slow) / LATENCY_FOR_S, 1),
                  "late_tokens_returned_while_slow": late_while_slow})
    stage.facts.update(facts)
    check(facts["statuses"] == {"succeeded": n} and facts["called_twice"] == 0,
          f"items {facts['statuses']}, {facts['called_twice']} called twice (a lease of 10 s "
          "outlives any round trip here)")
    await stage.stop_all(workers)
    return facts


SLOW_S = 30.0
SLOW_LEASE_S = 30


async def upstream_slowed(stage: Stage) -> Facts:
    """Scenario 5: the upstream answers five times slower for SLOW_S, then recovers."""
    rate, burst, concurrency = 40.0, 5, 8
    upstream = stage.start_upstream(latency=(0.04, 0.08))
    stage.write_policies(rate=rate, burst=burst, lease=SLOW_LEASE_S, timeout=5)
    n = 1500
    keys = await stage.register([f"o{i}" for i in range(n)])
    worker = stage.start_worker(workers=concurrency)
    await stage.wait_started(worker)
    await stage.release()

    async def calling() -> bool:
        return len(upstream.calls()) >= 200

    await stage.wait_for("calls before the slowdown", calling, 30, 0.05)
    rss_before = await worker.peak_rss_kib()
    upstream.set_latency((0.2, 0.4))
    slowed_at = time.time()
    await asyncio.sleep(SLOW_S)
    upstream.set_latency((0.04, 0.08))
    rss_after = await worker.peak_rss_kib()
    await stage.wait_all_finished(n, 180)
    calls = upstream.calls()
    while_slow = [c.wall_time for c in calls if slowed_at <= c.wall_time < slowed_at + SLOW_S]
    facts = await judge(stage, calls, keys, rate=rate, burst=burst, lease_s=SLOW_LEASE_S)
    facts.update({
        "slow_s": SLOW_S, "max_in_flight": upstream.max_in_flight(), "concurrency": concurrency,
        "calls_while_slow_per_s": round(len(while_slow) / SLOW_S, 1),
        "peak_rss_growth_mib": round((rss_after - rss_before) / 1024, 1)})
    stage.facts.update(facts)
    check(facts["max_in_flight"] <= concurrency,
          f"{facts['max_in_flight']} calls in flight at once, beyond the pool's {concurrency}")
    check(facts["peak_rss_growth_mib"] < 20,
          f"the worker's peak memory grew {facts['peak_rss_growth_mib']} MiB while slowed")
    check(facts["statuses"] == {"succeeded": n} and facts["called_twice"] == 0,
          f"items {facts['statuses']}, {facts['called_twice']} called twice (no lease "
          "should expire here)")
    await stage.stop_all([worker])
    return facts


DRILLS = [
    Drill(27, "upstream-slowed",
          "1,500 items at 40/s (burst 5), a worker process of 8 calls; the upstream answers in "
          "40-80 ms",
          f"the upstream answers five times slower (200-400 ms) for {SLOW_S:.0f} s, then "
          "recovers",
          "calls in flight never exceed the pool's concurrency, no second exceeds rate + "
          "burst, the worker's memory stays flat, every item succeeds once",
          upstream_slowed),
    Drill(28, "database-latency",
          "1,500 items at 50/s, two worker processes reaching PostgreSQL through the drill's "
          "fault proxy",
          f"PostgreSQL {int(LATENCY_S[0] * 1000)}-{int(LATENCY_S[1] * 1000)} ms further away "
          f"each way (latency with jitter) for {LATENCY_FOR_S:.0f} s",
          "no second over rate + burst, no lease lost (nothing called twice), every item "
          "succeeds; the drill reports the calls per second the round trips allow",
          database_latency),
]

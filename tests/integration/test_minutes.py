"""The ledger's minutes (service/history/): what a worker pool drains is counted in them as
the ledger records it, concurrent writers add rather than overwrite, the leader's samples
hold the backlog, the charts' series bucket them, and retention prunes them."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.cluster import retention
from service.history import minutes, sampler
from service.history.tally import Tally
from service.ledger import gauges
from service.upstreams.deletion_api import Upstreams
from service.worker import database_pool
from tests.fakes.upstream import FakeUpstream, Fault
from tests.integration.test_pipeline import (
    SCOPE,
    drain,
    make_policies,
    register,
    release_all,
    statuses,
)

DAY = 86_400


async def _rows(engine: AsyncEngine, sql: str) -> list[dict[str, object]]:
    async with engine.connect() as conn:
        return [dict(r._mapping) for r in (await conn.execute(text(sql))).all()]


async def test_a_drain_is_counted_as_the_ledger_records_it(engine: AsyncEngine) -> None:
    async with FakeUpstream() as upstream:
        policies = make_policies(upstream.base_url, max_attempts=5)
        await register(engine, policies, 30)
        run_id = await release_all(engine)
        upstream.inject(Fault.STATUS, times=3, status=429, headers={"Retry-After": "0"})
        upstream.inject(Fault.STATUS, times=2, status=503)
        ups = Upstreams(policies.upstreams)
        try:
            await drain(database_pool(engine, policies, ups, concurrency=4), engine)
        finally:
            await ups.aclose()
        calls = len(upstream.calls())
    assert await statuses(engine) == {"succeeded": 30}
    [policy] = await _rows(engine, "SELECT sum(succeeded) AS succeeded, sum(throttled) AS "
                                   "throttled, sum(transient) AS transient, sum(dead) AS dead, "
                                   "sum(closures) AS closures FROM policy_minutes "
                                   "WHERE policy = 'carts'")
    assert policy == {"succeeded": 30, "throttled": 3, "transient": 2, "dead": 0,
                      "closures": 3}
    [scope] = await _rows(engine, "SELECT sum(calls) AS calls, sum(succeeded) AS succeeded, "
                                  f"sum(throttled) AS throttled FROM scope_minutes "
                                  f"WHERE scope = '{SCOPE}'")
    assert scope == {"calls": calls, "succeeded": 30, "throttled": 3}
    # the run's progress: every item of its batches, finished
    series = await minutes.of_run(engine, "hour", time.time(), run_id)
    assert sum(v or 0 for v in series.ys["succeeded"]) == 30
    outcomes = await minutes.outcomes(engine, "hour", time.time())
    assert sum(v or 0 for v in outcomes.ys["succeeded"]) == 30


def _tally(minute: datetime, n: int) -> Tally:
    tally = Tally()
    tally.policies[minute, "carts"] = Counter(succeeded=n)
    tally.scopes[minute, SCOPE, "carts"] = Counter(calls=n)
    return tally


async def test_writers_add_to_the_same_minute_rather_than_overwrite(engine: AsyncEngine
                                                                    ) -> None:
    minute = datetime.now(UTC).replace(second=0, microsecond=0)
    await asyncio.gather(*(minutes.add(engine, _tally(minute, n)) for n in range(1, 21)))
    [row] = await _rows(engine, "SELECT succeeded FROM policy_minutes")
    [scope] = await _rows(engine, "SELECT calls FROM scope_minutes")
    assert row["succeeded"] == scope["calls"] == sum(range(1, 21))


async def test_a_day_reads_in_quarter_hours_with_gaps_left_empty(engine: AsyncEngine) -> None:
    now = time.time()
    bucket = now - now % 900
    first = datetime.fromtimestamp(bucket, UTC)  # three minutes in the newest quarter hour
    for m in range(3):
        await minutes.add(engine, _tally(first + timedelta(minutes=m), 10))
    await minutes.add(engine, _tally(first - timedelta(hours=2), 7))
    await minutes.add(engine, _tally(first - timedelta(days=2), 1000))  # outside the day
    series = await minutes.outcomes(engine, "day", now)
    assert len(series.x) == 96 and series.x[-1] == bucket and series.bucket_s == 900
    values = series.ys["succeeded"]
    assert values[-1] == 30 and values[-9] == 7
    assert sum(v is None for v in values) == 94


async def test_the_leaders_sample_records_every_policys_backlog(engine: AsyncEngine) -> None:
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 12)
    await release_all(engine)
    collector = gauges.LedgerCollector(engine, ["carts"])
    await sampler.sample_once(engine, collector, ["carts", "quiet"])
    rows = await _rows(engine, "SELECT policy, eligible, oldest_eligible_s > 0 AS aged "
                               "FROM policy_minutes ORDER BY policy")
    assert rows == [{"policy": "carts", "eligible": 12, "aged": True},
                    {"policy": "quiet", "eligible": 0, "aged": False}]
    eligible, oldest = await minutes.backlog(engine, "hour", time.time())
    assert eligible.ys["carts"][-1] == 12 and oldest.ys["carts"][-1] > 0


async def test_retention_prunes_old_minutes_only(engine: AsyncEngine) -> None:
    now = datetime.now(UTC).replace(second=0, microsecond=0)
    for when in (now - timedelta(days=40), now - timedelta(days=31), now - timedelta(days=1)):
        await minutes.add(engine, _tally(when, 1))
    pruned = await retention.prune(engine, keep_seconds=30 * DAY, evidence_keep_seconds=0,
                                   batch_size=1)
    assert pruned.minutes == 4  # two old minutes in each of the two tables
    assert [r["n"] for r in await _rows(engine, "SELECT count(*) AS n FROM policy_minutes "
                                                "UNION ALL SELECT count(*) FROM scope_minutes")
            ] == [1, 1]

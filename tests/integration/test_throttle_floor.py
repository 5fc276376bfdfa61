"""An upstream that answers every call over its limit with 429 and `Retry-After: 0` (or a
date already past) must still slow Sweeper down to about its limit: such a Retry-After is no
usable date, so the scope closes by the policy's backoff, never for less than its base, as
for a 429 without Retry-After. The real worker pool runs against the fake upstream over
loopback."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.upstreams.deletion_api import Upstreams
from service.worker import database_pool
from tests.fakes.upstream import FakeUpstream, Fault, over_limit
from tests.integration.test_pipeline import make_policies, register, release_all

UPSTREAM_PER_SECOND = 5  # the fake lets this many calls through in any trailing second
POLICY_PER_SECOND = 100  # the policy's budget is far above the upstream's real limit
POLICY_BURST = 5
# max = base holds every closure at the floor, so the run measures the floor itself (how the
# backoff grows is drill 11's subject)
BACKOFF_S = 1.0
RUN_S = 4.0  # how long the pool runs (the bound below counts the calls' recorded span)


@pytest.mark.slow
@pytest.mark.parametrize("retry_after", ["0", "Sun, 06 Nov 1994 08:49:37 GMT"])
async def test_an_unusable_retry_after_still_holds_calls_near_the_upstream_limit(
        engine: AsyncEngine, retry_after: str) -> None:
    async with FakeUpstream() as upstream:
        policies = make_policies(
            upstream.base_url, max_attempts=1000,
            rate={"per_second": POLICY_PER_SECOND, "burst": POLICY_BURST},
            backoff={"base_seconds": BACKOFF_S, "max_seconds": BACKOFF_S})
        await register(engine, policies, 400)  # more than the run can reach: never idle
        await release_all(engine)
        upstream.inject(Fault.STATUS, times=None, status=429,
                        headers={"Retry-After": retry_after},
                        match=over_limit(UPSTREAM_PER_SECOND))
        ups = Upstreams(policies.upstreams)
        pool = database_pool(engine, policies, ups, concurrency=16)
        task = asyncio.create_task(pool.run())
        await asyncio.sleep(RUN_S)
        pool.stop()
        await task
        await ups.aclose()
    calls = upstream.calls()
    passed = sum(c.outcome == "ok" for c in calls)
    # The seconds from the first call to the last, as the attempts recorded them: on a
    # loaded machine the sleep above lasts longer than RUN_S, and the calls with it.
    async with engine.connect() as conn:
        span = float((await conn.execute(text(
            "SELECT extract(epoch FROM max(started_at) - min(started_at)) FROM attempts"))
        ).scalar_one())
    # Every closure lasts at least the backoff, so the run has at most this many openings;
    # each lets out at most the policy's burst before its first 429 is back (the pool then
    # holds the scope at once).
    openings = int(span / BACKOFF_S) + 1
    bound = UPSTREAM_PER_SECOND * span + UPSTREAM_PER_SECOND + openings * POLICY_BURST
    assert len(calls) <= bound, (len(calls), passed)
    # and the pool went on calling at about the upstream's pace
    assert passed >= 2 * UPSTREAM_PER_SECOND, (len(calls), passed)

"""Fairness under a huge skew. (The shared budget across worker processes is drill 12,
drills/operations.py.)"""

from __future__ import annotations

import asyncio
import os

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from service.upstreams.deletion_api import Upstreams
from service.worker import database_pool
from tests.conftest import eventually
from tests.fakes.upstream import FakeUpstream
from tests.integration.test_pipeline import make_policies, register, release_all


async def scalar(db_url: str, sql: str) -> float:
    conn = await asyncpg.connect(db_url)
    try:
        return float(await conn.fetchval(sql))
    finally:
        await conn.close()


@pytest.mark.slow
async def test_a_huge_backlog_does_not_starve_a_small_scope(engine: AsyncEngine,
                                                             db_url: str) -> None:
    big = int(os.environ.get("SWEEPER_TEST_SKEW_BACKLOG", "200000"))
    async with FakeUpstream() as upstream:
        policies = make_policies(upstream.base_url, rate={"per_second": 5, "burst": 1})
        await register(engine, policies, 10, tenant="small")
        await register(engine, policies, 1, tenant="big")
        # the big backlog is seeded in SQL (registering a million items over HTTP is the
        # benchmark's business), released and ready, in the same scope row shape
        conn = await asyncpg.connect(db_url)
        try:
            await conn.execute("""
                INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key,
                                   scope, due_at, released_at)
                SELECT 'big', 'b' || g, 'carts', 1, encode(sha256(('b' || g)::bytea), 'hex'),
                       'tenant:big', now() - interval '1 day', now()
                FROM generate_series(1, $1) g
            """, big)
            await conn.execute("UPDATE scopes SET rate_per_second = 200, burst = 10, "
                               "budget_from_policy = false WHERE name = 'tenant:big'")
            await conn.execute("ANALYZE items")
        finally:
            await conn.close()
        await release_all(engine)
        ups = Upstreams(policies.upstreams)
        pool = database_pool(engine, policies, ups, concurrency=8)
        task = asyncio.create_task(pool.run())
        try:
            # both scopes served: the small one drained, and the big one not starved either
            # (half the slots are its; how fast it goes is the machine's speed)
            await eventually(lambda: scalar(db_url, """
                SELECT count(*) FILTER (WHERE tenant_id = 'small') = 10
                       AND count(*) FILTER (WHERE tenant_id = 'big') >= 50
                FROM items WHERE status = 'succeeded'"""),
                "the small scope's 10 items and 50 of the big one's succeeded")
        finally:
            pool.stop()
            await task
            await ups.aclose()
    # 10 items at 5/s with burst 1: about 2 s at its own pace, never behind the million. The
    # pace is read from what the pool recorded on the items (a success's call start and its
    # completion), from its first call of all: neither its start-up nor this test's polling
    # on a loaded machine counts.
    small_done = await scalar(db_url, """
        SELECT extract(epoch FROM max(completed_at) FILTER (WHERE tenant_id = 'small')
                                  - min(last_started_at))
        FROM items WHERE status = 'succeeded'""")
    assert small_done < 10 / 5 + 2.5, small_done

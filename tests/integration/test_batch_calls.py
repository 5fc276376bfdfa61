"""Many objects per call on a real database and over loopback: a token is a call of up to
`max_objects` items, the claim charges a token per started group, an unstarted call gives
its one token back, and a partial failure retries only the objects that failed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.config.policies import Policies
from service.ledger import claims, registration
from service.upstreams.deletion_api import Upstreams
from service.worker.process import database_pool
from tests.conftest import policies_from
from tests.fakes.upstream import FakeUpstream, Fault
from tests.integration.test_pipeline import PAST, drain, release_all

SCOPE = "bulk:acme"


def make_policies(port: int, **batch: Any) -> Policies:
    return policies_from({
        "upstreams": {"api": {"base_url": f"http://127.0.0.1:{port}", "timeout_seconds": 2}},
        "policies": {"bulk": {
            "version": 1, "upstream": "api", "path": "/{tenant_id}/customers?ids={object_ids}",
            "scope": "{policy}:{tenant_id}", "rate": {"per_second": 100, "burst": 10},
            "batch": {"max_objects": 3, **batch}, "lease_seconds": 30, "max_attempts": 3,
            "backoff": {"base_seconds": 0.01, "max_seconds": 0.02}}}})


async def register(engine: AsyncEngine, policies: Policies, n: int) -> None:
    policy = policies.policies["bulk"]
    await registration.register(engine, [registration.Registration("acme", f"c{i}", policy, PAST)
                                   for i in range(n)])
    await release_all(engine)


async def tokens(engine: AsyncEngine) -> float:
    async with engine.connect() as conn:
        return float((await conn.execute(text(
            "SELECT tokens FROM scopes WHERE name = :n"), {"n": SCOPE})).scalar_one())


async def set_tokens(engine: AsyncEngine, value: float) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE scopes SET tokens = :t, refilled_at = now(), "
                                "rate_per_second = 0.001"), {"t": value})


@pytest.mark.parametrize(("ready", "asked", "leased", "charged"), [
    (10, 2, 6, 2),   # two tokens: two calls of three
    (4, 2, 4, 2),    # three and one: still two calls
    (2, 2, 2, 1),    # one call of two: one token, the other stays in the bucket
])
async def test_a_token_is_a_call_of_up_to_max_objects(
        engine: AsyncEngine, ready: int, asked: int, leased: int, charged: int) -> None:
    policies = make_policies(9)
    await register(engine, policies, ready)
    async with engine.connect() as conn:
        per_call = (await conn.execute(text("SELECT objects_per_call FROM scopes"))
                    ).scalar_one()
    assert per_call == 3
    await set_tokens(engine, 5)
    admitted = await claims.admit(engine, owner="t", wants={SCOPE: asked},
                                  lease_seconds={"bulk": 30}, lookahead_s=0)
    assert len(admitted.leases) == leased
    assert admitted.grants[0].per_call == 3 and admitted.grants[0].granted == asked
    assert await tokens(engine) == pytest.approx(5 - charged, abs=0.01)
    # handed back unstarted, each call returns its one token (with its first lease)
    first = admitted.leases[:3]
    await claims.hand_back(engine, first, [1] + [0] * (len(first) - 1))
    assert await tokens(engine) == pytest.approx(5 - charged + 1, abs=0.01)



async def test_a_partial_failure_retries_only_the_objects_that_failed(
        engine: AsyncEngine, upstream: FakeUpstream) -> None:
    # the first call's answer names c1 as not deleted; every later call deletes all
    failed = {"errors": [{"id": "c1", "message": "customer has open orders"}]}
    upstream.inject(Fault.STATUS, times=1, status=200,
                    headers={"Content-Type": "application/json"},
                    body=json.dumps(failed).encode())
    policies = make_policies(upstream.port, failed="errors[*].id")
    await register(engine, policies, 3)
    ups = Upstreams(policies.upstreams)
    try:
        await drain(database_pool(engine, policies, ups, concurrency=2), engine)
    finally:
        await ups.aclose()
    calls = upstream.calls()
    assert [c.query for c in calls] == ["ids=c0,c1,c2", "ids=c1"]
    assert calls[0].idempotency_key != calls[1].idempotency_key  # another batch
    async with engine.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT i.object_id, i.status, i.attempts, "
            "array_agg(a.outcome || ':' || coalesce(a.error_code, '') ORDER BY a.id) "
            "FILTER (WHERE a.id IS NOT NULL) "
            "FROM items i LEFT JOIN attempts a ON a.item_id = i.id "
            "GROUP BY i.object_id, i.status, i.attempts ORDER BY i.object_id"))).all()
    # a success has no attempt row: only c1's failed first attempt has one
    assert [tuple(r) for r in rows] == [
        ("c0", "succeeded", 1, None),
        ("c1", "succeeded", 2, ["transient:http_200:object_failed"]),
        ("c2", "succeeded", 1, None)]

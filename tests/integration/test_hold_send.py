"""Holds bind at the send (service/worker/hold_gate.py): calls already leased and waiting for
the upstream's one connection when `POST /v1/holds` answers never start, on a worker that
learns of the hold by notification and on one that only polls; `in_flight` names exactly
the call that had started. Through HTTP, a real database and the fake upstream on loopback.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.config.policies import Policies
from service.config.settings import async_url, plain_url
from service.ledger import registration
from service.runs import publication, trigger
from service.upstreams.deletion_api import Upstreams
from service.worker import database_pool
from tests.conftest import LiveServer, eventually, policies_from, test_settings
from tests.fakes.upstream import FakeUpstream, Fault
from tests.integration.test_pipeline import PAST

ITEMS = 4


def one_connection(base_url: str) -> Policies:
    """An upstream taking one connection at a time, and a slow budget whose tokens may be
    spent up to 5 s late: calls wait for the connection that long."""
    return policies_from({
        "upstreams": {"shop": {"base_url": base_url, "timeout_seconds": 10,
                               "max_connections": 1}},
        "policies": {"carts": {
            "version": 1, "upstream": "shop", "path": "/carts/{tenant_id}/{object_id}",
            "scope": "tenant:{tenant_id}", "rate": {"per_second": 0.2, "burst": 10},
            "lease_seconds": 60, "max_attempts": 3}}})



async def leased(engine: AsyncEngine) -> dict[str, Any]:
    async with engine.connect() as conn:
        return {r.object_id: r for r in (await conn.execute(text(
            "SELECT id, object_id, hold_id, attempts, "
            "CASE WHEN lease_token IS NOT NULL THEN 'leased' ELSE status END AS status "
            "FROM items"))).all()}


@pytest.mark.slow  # the one call in flight lasts 2 s: the hold is placed meanwhile
@pytest.mark.parametrize("notified", [True, False], ids=["notified", "polling"])
async def test_no_leased_call_starts_after_the_hold_answers(
        db_url: str, engine: AsyncEngine, upstream: FakeUpstream, notified: bool) -> None:
    upstream.inject(Fault.STATUS, times=None, status=204, delay=2.0)
    policies = one_connection(upstream.base_url)
    await registration.register(engine, [registration.Registration("acme", f"c-{n}",
                                                                   policies.policies["carts"], PAST)
                                   for n in range(ITEMS)])
    run_id, _ = await trigger.create_run(engine, trigger.RunRequest(None, None, None,
                                                                    False, None),
                                         None)
    assert await publication.publish(engine, run_id, batch_size=50)
    ups = Upstreams(policies.upstreams)
    pool = database_pool(engine, policies, ups, concurrency=ITEMS,
                         listen_url=plain_url(async_url(db_url)) if notified else None)
    runner = asyncio.create_task(pool.run())
    try:
        async with LiveServer(test_settings(db_url), policies, db_url) as live, \
                live.client(timeout=30) as client:
            # every item leased: one call on the connection, the others waiting for it
            async def all_leased() -> bool:
                state = await leased(engine)
                return (len(upstream.calls()) == 1
                        and all(r.status == "leased" for r in state.values()))
            await eventually(all_leased, "every item leased, one of them called")
            answer = await client.post("/v1/holds", json={
                "tenant_id": "acme", "reason": "litigation", "reference": "CASE-9"})
            assert answer.status_code == 201, answer.text
            hold = answer.json()
            calls_at_answer = len(upstream.calls())

            async def settled() -> bool:
                return not any(r.status == "leased" for r in (await leased(engine)).values())
            await eventually(settled, "no item leased")
    finally:
        pool.stop()
        await runner
        await ups.aclose()
    state = await leased(engine)
    called = {call.path.rsplit("/", 1)[1] for call in upstream.calls()}
    # the calls that reached the upstream are exactly those the hold lists as in flight:
    # none started after it answered, and those waiting for the connection never did
    assert calls_at_answer == len(upstream.calls()) == len(called) < ITEMS
    assert hold["in_flight"] == {"count": len(called),
                                 "item_ids": sorted(state[o].id for o in called)}
    assert all(state[o].status == "succeeded" for o in called)
    held = [r for r in state.values() if r.object_id not in called]
    assert [(r.status, r.hold_id, r.attempts) for r in held] == [
        ("pending", hold["id"], 0)] * len(held)
    async with engine.connect() as conn:
        acks = (await conn.execute(text(
            "SELECT worker, revoked FROM hold_acks WHERE hold_id = :id"),
            {"id": hold["id"]})).all()
    assert [(a.worker, sorted(a.revoked)) for a in acks] == [
        (pool.name, sorted(r.id for r in held))]

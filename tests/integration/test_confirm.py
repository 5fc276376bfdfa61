"""Confirmation reads through the production path: a real database, a worker pool, the fake
upstream on loopback. A deletion that answered success is `succeeded` only once a read of
its object finds it absent; the read is claimed again through the normal admission, so it
spends the scope's budget; evidence says whether the deletion was confirmed."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.evidence import deletion_records
from service.ledger import registration
from service.upstreams.deletion_api import Upstreams
from service.worker import database_pool
from tests.fakes.upstream import FakeUpstream, Fault, Objects
from tests.integration.test_pipeline import (
    drain,
    make_policies,
    register,
    release_all,
    statuses,
)

CONFIRM = {"path": "/carts/{object_id}", "absent": [404, 410], "share": 1.0}



async def evidence(engine: AsyncEngine) -> dict[str, dict[str, Any]]:
    """Every record in the evidence log, by object id."""
    async with engine.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT records FROM evidence_log ORDER BY seq_end"))).all()
    records = [deletion_records.parse(data) for r in rows
               for data in deletion_records.frames(bytes(r.records))]
    return {r["object_id"]: r for r in records}


async def items(engine: AsyncEngine) -> dict[str, Any]:
    async with engine.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT object_id, status, dead_reason, attempts, confirming FROM items"))).all()
    return {r.object_id: r for r in rows}


async def run_pool(engine: AsyncEngine, upstream: FakeUpstream, n: int, *,
                   objects: Objects, rounds: int = 200, **policy: Any) -> None:
    policies = make_policies(upstream.base_url, **policy)
    upstream.route("/carts/", objects)
    await register(engine, policies, n)
    await release_all(engine)
    ups = Upstreams(policies.upstreams)
    try:
        await drain(database_pool(engine, policies, ups, concurrency=8), engine, rounds)
    finally:
        await ups.aclose()


async def test_a_deletion_read_as_absent_succeeds_with_evidence_saying_confirmed(
        engine: AsyncEngine, upstream: FakeUpstream) -> None:
    objects = Objects("/carts/", [f"cart-{i}" for i in range(10)])
    await run_pool(engine, upstream, 10, objects=objects, confirm=CONFIRM)
    assert await statuses(engine) == {"succeeded": 10}
    assert objects.held() == set()
    calls = upstream.calls()
    for i in range(10):
        mine = [c for c in calls if c.path == f"/carts/cart-{i}"]
        # the deletion first, then the read; the read changes nothing and carries no key
        assert [c.method for c in mine] == ["DELETE", "GET"]
        assert mine[0].idempotency_key == registration.operation_key("acme", f"cart-{i}",
                                                                     "carts", 1)
        assert mine[1].idempotency_key is None
    found = await evidence(engine)
    assert set(found) == {f"cart-{i}" for i in range(10)}
    assert all(r["confirmed"] is True and r["outcome"] == "succeeded"
               and r["upstream_status"] == 404 and r["attempts"] == 1
               for r in found.values())
    assert not any(r.confirming for r in (await items(engine)).values())


async def test_a_deletion_that_did_not_take_is_retried_and_dies_not_confirmed(
        engine: AsyncEngine, upstream: FakeUpstream) -> None:
    # the upstream answers 204 to every DELETE and keeps serving the object
    objects = Objects("/carts/", ["cart-0", "cart-1"], keep=True)
    await run_pool(engine, upstream, 2, objects=objects, confirm=CONFIRM, max_attempts=3)
    assert await statuses(engine) == {"dead": 2}
    for object_id, item in (await items(engine)).items():
        assert item.dead_reason == "max_attempts:not_confirmed", object_id
        assert item.attempts == 3 and not item.confirming
        mine = [c for c in upstream.calls() if c.path == f"/carts/{object_id}"]
        # an attempt is one deletion (the same key each time) and its read
        assert [c.method for c in mine] == ["DELETE", "GET"] * 3
        assert len({c.idempotency_key for c in mine if c.method == "DELETE"}) == 1
    assert await evidence(engine) == {}


async def test_a_read_that_fails_records_no_success_and_is_made_again(
        engine: AsyncEngine, upstream: FakeUpstream) -> None:
    objects = Objects("/carts/", ["cart-0"])
    upstream.inject(Fault.STATUS, times=2, status=503,
                    match=lambda c: c.method == "GET")
    await run_pool(engine, upstream, 1, objects=objects, confirm=CONFIRM, max_attempts=5)
    assert await statuses(engine) == {"succeeded": 1}
    # deleted once; read three times (two 503s, then the 404)
    assert [c.method for c in upstream.calls()] == ["DELETE", "GET", "GET", "GET"]
    assert (await evidence(engine))["cart-0"]["confirmed"] is True
    async with engine.connect() as conn:
        outcomes = (await conn.execute(text(
            "SELECT outcome, error_code FROM attempts ORDER BY id"))).all()
    assert [tuple(r) for r in outcomes] == [
        ("succeeded", None), ("transient", "confirm:http_503"),
        ("transient", "confirm:http_503")]  # then the read's success, on the item


async def test_a_share_confirms_only_the_items_it_chooses(
        engine: AsyncEngine, upstream: FakeUpstream) -> None:
    n = 40
    objects = Objects("/carts/", [f"cart-{i}" for i in range(n)])
    share = {**CONFIRM, "share": 0.5}
    await run_pool(engine, upstream, n, objects=objects, confirm=share)
    assert await statuses(engine) == {"succeeded": n}
    policy = make_policies(upstream.base_url, confirm=share).policies["carts"]
    chosen = {f"cart-{i}" for i in range(n)
              if policy.confirms(registration.operation_key("acme", f"cart-{i}", "carts", 1))}
    assert 0 < len(chosen) < n
    read = {c.path.removeprefix("/carts/") for c in upstream.calls() if c.method == "GET"}
    assert read == chosen
    assert len([c for c in upstream.calls() if c.method == "GET"]) == len(chosen)
    found = await evidence(engine)
    assert {k for k, r in found.items() if r["confirmed"]} == chosen
    assert {k for k, r in found.items() if not r["confirmed"]} == set(found) - chosen


async def test_the_read_spends_the_scopes_budget(engine: AsyncEngine,
                                                 upstream: FakeUpstream) -> None:
    # 4 items at 8 calls a second, burst 1: 4 deletions and 4 reads are 8 calls, which the
    # bucket spaces 1/8 s apart; without the reads' tokens they would take half as long
    objects = Objects("/carts/", [f"cart-{i}" for i in range(4)])
    await run_pool(engine, upstream, 4, objects=objects, confirm=CONFIRM,
                   rate={"per_second": 8, "burst": 1})
    assert await statuses(engine) == {"succeeded": 4}
    calls = sorted(upstream.calls(), key=lambda c: c.received_at)
    assert [c.method for c in calls].count("GET") == 4 and len(calls) == 8
    # 7 gaps of a token each, less scheduling jitter (reads made without a token would
    # leave the 4 deletions' 3/8 s)
    span = calls[-1].received_at - calls[0].received_at
    assert span >= 7 / 8 - 0.1, span

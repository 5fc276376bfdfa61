"""One bad row fails alone (issue 46, point 4): a store batch whose statement fails on one
id (a cast error, a lock held by a shopper) is split and run again, so its other rows are
deleted on their own merits; only the bad id ends dead with its reason, the busy one goes
back transient. Against a real store database (tests/fakes/store_schema.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.ledger import registration
from service.outcomes import Classified, Outcome
from service.sweeps.store_databases import Stores
from service.sweeps.store_targets import StoreTargets
from service.upstreams.deletion_api import Upstreams
from service.worker import database_pool
from tests.conftest import LiveServer, test_settings
from tests.fakes.store_schema import create_store, store_policies
from tests.integration.test_pipeline import PAST, drain
from tests.integration.test_stores import publish_carts

INJECTION = "1); DROP TABLE carts;--"


@pytest.fixture
async def store(store_db_url: str) -> AsyncIterator[asyncpg.Connection]:
    await create_store(store_db_url)
    conn = await asyncpg.connect(store_db_url)
    await conn.execute("INSERT INTO carts (shop, updated_at) SELECT 'shop-1', "
                       "now() - interval '30 days' FROM generate_series(1, 6)")
    yield conn
    await conn.close()


async def test_an_id_the_cast_refuses_fails_alone_and_its_batch_mates_are_deleted(
        engine: AsyncEngine, store_db_url: str, store: asyncpg.Connection) -> None:
    policies = store_policies(store_db_url)
    leases = sorted(await publish_carts(engine, policies), key=lambda lease: lease.object_id)
    assert len(leases) == 6
    # one item names no cart: its id cannot be cast to the statement's bigint[]
    kept = leases[2].object_id
    leases[2] = dataclasses.replace(leases[2], object_id=INJECTION)
    stores = Stores(policies.stores)
    try:
        result = await StoreTargets(stores, engine).delete(
            policies.policies["expired-carts"], leases)
    finally:
        await stores.aclose()
    assert result.verdict is not None and result.verdict.outcome is Outcome.SUCCEEDED
    assert result.verdicts == {INJECTION: Classified(Outcome.PERMANENT,
                                                     "store_refused:22P02")}
    assert result.skipped == frozenset()
    # the five real carts are gone; the one whose item was replaced is still there
    assert [str(r["id"]) for r in await store.fetch("SELECT id FROM carts")] == [kept]
    recorded = await store.fetchval("SELECT deleted FROM cleanup_ledger")
    assert sorted(recorded) == sorted(lease.object_id for n, lease in enumerate(leases)
                                      if n != 2)


async def test_a_row_a_shopper_holds_goes_back_transient_and_the_rest_are_deleted(
        engine: AsyncEngine, store_db_url: str, store: asyncpg.Connection) -> None:
    """Through the worker pool: the held row's item goes back to pending (store_busy), the
    others succeed; once the shopper lets go, it is deleted too."""
    policies = store_policies(store_db_url)
    held = await store.fetchval("SELECT min(id) FROM carts")
    shopper = await asyncpg.connect(store_db_url)
    await shopper.execute("BEGIN")
    await shopper.execute("SELECT * FROM carts WHERE id = $1 FOR UPDATE", held)
    leases = await publish_carts(engine, policies)
    assert len(leases) == 6
    stores = Stores(policies.stores)
    try:
        result = await StoreTargets(stores, engine).delete(
            policies.policies["expired-carts"], leases)
        assert result.verdicts == {str(held): Classified(Outcome.TRANSIENT,
                                                         "store_busy:55P03")}
        assert [r["id"] for r in await store.fetch("SELECT id FROM carts")] == [held]
    finally:
        await stores.aclose()
        await shopper.execute("ROLLBACK")
        await shopper.close()


async def test_the_worker_records_each_rows_own_outcome(
        engine: AsyncEngine, store_db_url: str, store: asyncpg.Connection) -> None:
    policies = store_policies(store_db_url)
    held = await store.fetchval("SELECT min(id) FROM carts")
    shopper = await asyncpg.connect(store_db_url)
    await shopper.execute("BEGIN")
    await shopper.execute("SELECT * FROM carts WHERE id = $1 FOR UPDATE", held)
    await publish_carts(engine, policies)
    async with engine.begin() as conn:  # hand the leases back: the pool claims them
        await conn.execute(text("UPDATE items SET status = 'pending', lease_owner = NULL, "
                                "lease_token = NULL, lease_expires_at = NULL"))
    ups = Upstreams(policies.upstreams)
    stores = Stores(policies.stores)
    pool = database_pool(engine, policies, ups, concurrency=2, stores=stores)
    try:
        await pool.run_once()
        await pool.drain()
        async with engine.connect() as conn:
            rows = (await conn.execute(text(
                "SELECT object_id, status, last_error FROM items ORDER BY object_id"))).all()
        got = {r.object_id: (r.status, r.last_error) for r in rows}
        assert got.pop(str(held)) == ("pending", "store_busy:55P03")
        assert set(got.values()) == {("succeeded", None)} and len(got) == 5
        await shopper.execute("ROLLBACK")
        await drain(pool, engine)
        assert await store.fetchval("SELECT count(*) FROM carts") == 0
    finally:
        await pool.drain()
        await ups.aclose()
        await stores.aclose()
        await shopper.close()


async def test_an_id_the_statements_type_cannot_take_is_refused_at_registration(
        db_url: str, engine: AsyncEngine, store_db_url: str, store: asyncpg.Connection
        ) -> None:
    """The worked example casts ids to bigint[]: the issue's id is a 422 naming the item's
    object_id, and nothing of the request is registered; the ledger refuses it for every
    caller."""
    policies = store_policies(store_db_url)
    policy = policies.policies["expired-carts"]
    assert policy.object_id_type == "bigint"
    with pytest.raises(registration.ObjectIdRefused) as refused:
        await registration.register(engine, [registration.Registration("shop-1", "7", policy, PAST),
                                             registration.Registration("shop-1", INJECTION, policy,
                                                                       PAST)])
    assert refused.value.index == 1 and INJECTION not in str(refused.value)
    async with LiveServer(test_settings(db_url), policies, db_url) as server, \
            server.client() as client:
        items = [{"tenant_id": "shop-1", "object_id": object_id, "policy": "expired-carts",
                  "due_at": "2020-01-01T00:00:00Z"}
                 for object_id in ("7", INJECTION, "9223372036854775808", " 8 ")]
        answer = await client.post("/v1/items", json={"items": items})
        assert answer.status_code == 422, answer.text
        assert answer.headers["content-type"] == "application/problem+json"
        errors = answer.json()["errors"]
        assert [(e["loc"], e["type"]) for e in errors] == [
            (["body", "items", str(n), "object_id"], "invalid_object_id") for n in (1, 2)]
        assert "bigint" in errors[0]["message"] and INJECTION not in answer.text
        answer = await client.post("/v1/items", json={"items": [items[0], items[3]]})
        assert answer.status_code == 200, answer.text

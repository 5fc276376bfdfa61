"""One identity per tenant where the tenant id makes the upstream's host
(service/config/tenants.py): every entry stores one spelling, so a hold on it covers every spelling
a caller uses, one object has one operation key, and an ambiguous spelling is refused naming the
canonical one. Through HTTP, a real database and the fake upstream on loopback (`localhost` is its
host)."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.config.policies import Policies
from service.config.tenants import host_form
from service.errors import ConfigError
from service.ledger import registration, tenant_spellings
from service.upstreams.deletion_api import Upstreams
from service.worker import database_pool
from tests.conftest import LiveServer, policies_from, test_settings
from tests.fakes.store_schema import store_policies
from tests.fakes.upstream import FakeUpstream
from tests.integration.test_holds import drain
from tests.integration.test_pipeline import PAST, release_all
from tests.integration.test_request_templates import SECRET, item, make_policies


@pytest.fixture
async def live(db_url: str, upstream: FakeUpstream) -> AsyncIterator[httpx.AsyncClient]:
    async with LiveServer(test_settings(db_url), make_policies(upstream.port), db_url) as server:
        async with server.client() as client:
            yield client


async def rows(engine: AsyncEngine) -> list[tuple[Any, ...]]:
    async with engine.connect() as conn:
        return [tuple(r) for r in (await conn.execute(text(
            "SELECT tenant_id, object_id, status, hold_id IS NOT NULL FROM items "
            "ORDER BY object_id, tenant_id"))).all()]


async def run_workers(engine: AsyncEngine, policies: Policies) -> None:
    """Release what is registered and drain it, all but one item (held, or refused)."""
    await release_all(engine)
    ups = Upstreams(policies.upstreams)
    try:
        await drain([database_pool(engine, policies, ups, concurrency=2)], engine, leave=1)
    finally:
        await ups.aclose()


def test_the_canonical_form() -> None:
    assert host_form("LocalHost") == host_form("LOCALHOST.") == "localhost"
    assert host_form("\uff2c\uff2f\uff23\uff21\uff2c\uff28\uff2f\uff33\uff34") == "localhost"
    assert host_form("B\u00fccher.Example") == "xn--bcher-kva.example"
    assert host_form("\u212a.example") == "k.example"  # the Kelvin sign
    assert host_form("a_b") == "a_b" and host_form("a..b") == "a..b"  # no host: as given


async def test_a_hold_covers_every_spelling_and_one_object_has_one_key(
        live: httpx.AsyncClient, engine: AsyncEngine, upstream: FakeUpstream) -> None:
    hold = await live.post("/v1/holds", json={
        "tenant_id": "localhost", "object_ids": ["h1"], "reason": "litigation",
        "reference": "CASE-1"})
    assert hold.status_code == 201, hold.text
    answer = await live.post("/v1/items", json={"items": [
        item("LocalHost", "h1"), item("LOCALHOST", "h2"), item("localhost.", "h2"),
        item("localhost", "h1")]})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"inserted": 2, "advanced": 0, "unchanged": 2}
    assert await rows(engine) == [("localhost", "h1", "pending", True),
                                  ("localhost", "h2", "pending", False)]
    await run_workers(engine, make_policies(upstream.port))
    assert await rows(engine) == [("localhost", "h1", "pending", True),
                                  ("localhost", "h2", "succeeded", False)]
    calls = upstream.calls()
    assert [json.loads(c.body)["variables"]["raw"] for c in calls] == ["h2"]
    assert calls[0].headers["host"] == f"localhost:{upstream.port}"
    assert calls[0].idempotency_key == registration.operation_key("localhost", "h2", "per-shop", 2)


async def test_a_webhook_in_another_spelling_is_held_too(
        live: httpx.AsyncClient, engine: AsyncEngine, upstream: FakeUpstream) -> None:
    hold = await live.post("/v1/holds", json={
        "tenant_id": "localhost", "reason": "regulator", "reference": "DPA-9"})
    assert hold.status_code == 201, hold.text
    body = json.dumps({"shop": "LOCALhost", "id": 42}).encode()
    answer = await live.post("/v1/webhooks/plain", content=body, headers={
        "X-Signature": hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest(),
        "X-Event": "customer.redact"})
    assert answer.status_code in (200, 202), answer.text
    assert await rows(engine) == [("localhost", "42", "pending", True)]
    await run_workers(engine, make_policies(upstream.port))
    assert upstream.calls() == []


async def test_an_ambiguous_spelling_is_refused_naming_the_canonical_one(
        live: httpx.AsyncClient, engine: AsyncEngine) -> None:
    refused = [
        await live.post("/v1/holds", json={"tenant_id": "LocalHost", "reason": "r",
                                           "reference": "c"}),
        await live.get("/v1/items", params={"tenant_id": "LocalHost"}),
        await live.get("/v1/holds", params={"tenant_id": "LocalHost"}),
        await live.get("/v1/evidence", params={"tenant_id": "LocalHost", "object_id": "1"}),
        await live.post("/v1/items/cancel", json={"tenant_id": "LocalHost", "why": "gone"}),
        await live.post("/v1/runs", json={"tenant_id": "LocalHost"}),
    ]
    for answer in refused:
        assert answer.status_code == 422, answer.text
        assert answer.headers["content-type"] == "application/problem+json"
        [error] = answer.json()["errors"]
        assert error["type"] == "tenant_not_canonical" and error["loc"][-1] == "tenant_id"
        assert "'localhost'" in error["message"] and "per-shop" in error["message"]
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM holds"))).scalar_one() == 0
        assert (await conn.execute(text("SELECT count(*) FROM runs"))).scalar_one() == 0
    # naming the policy decides the spelling; a policy whose host is fixed keeps it exactly
    named = await live.post("/v1/holds", json={"tenant_id": "LocalHost", "policy": "per-shop",
                                               "reason": "r", "reference": "c"})
    assert named.status_code == 201, named.text
    assert named.json()["tenant_id"] == "localhost"
    exact = await live.post("/v1/holds", json={"tenant_id": "LocalHost", "policy": "versioned",
                                               "reason": "r", "reference": "c"})
    assert exact.status_code == 201 and exact.json()["tenant_id"] == "LocalHost"
    listed = await live.get("/v1/items", params={"tenant_id": "LocalHost",
                                                 "policy": "per-shop"})
    assert listed.status_code == 200, listed.text


async def test_rows_stored_before_are_held_and_never_called(
        engine: AsyncEngine, upstream: FakeUpstream) -> None:
    """An active hold on an old spelling gets a canonical twin (once), and an open item
    stored in one is refused at its call instead of reaching the upstream."""
    policies = make_policies(upstream.port)
    async with engine.begin() as conn:
        await conn.execute(text(
            "INSERT INTO holds (tenant_id, policy, reason, reference, placed_by) "
            "VALUES ('LocalHost', NULL, 'old', 'CASE-0', 'op'), "
            "('LocalHost', 'versioned', 'fixed host', 'CASE-1', 'op')"))
        await conn.execute(text(
            "INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key, "
            "scope, due_at) VALUES ('LOCALHOST', 'old', 'per-shop', 2, :key, "
            "'shops:LOCALHOST', '2020-01-01Z')"),
            {"key": registration.operation_key("LOCALHOST", "old", "per-shop", 2)})
        await conn.execute(text(
            "INSERT INTO scopes (name, rate_per_second, burst, tokens, objects_per_call) "
            "VALUES ('shops:LOCALHOST', 1000, 1000, 1000, 1)"))
    assert await tenant_spellings.reconcile(engine, policies) == 1
    assert await tenant_spellings.reconcile(engine, policies) == 0
    await registration.register(engine, [registration.Registration(
        "LocalHost", "new", policies.policies["per-shop"], PAST)])
    async with engine.connect() as conn:
        twins = (await conn.execute(text(
            "SELECT tenant_id, policy, placed_by FROM holds WHERE tenant_id = 'localhost'"
        ))).all()
    assert [tuple(t) for t in twins] == [("localhost", None, "sweeper")]
    await run_workers(engine, policies)
    async with engine.connect() as conn:
        found = {r.object_id: (r.status, r.dead_reason, r.hold_id is not None)
                 for r in (await conn.execute(text(
                     "SELECT object_id, status, dead_reason, hold_id FROM items"))).all()}
    assert found == {"old": ("dead", "invalid_request", False),
                     "new": ("pending", None, True)}
    assert upstream.calls() == []



def insensitive_policies(base_url: str) -> Any:
    policy = {"version": 1, "upstream": "shop", "scope": "shop",
              "rate": {"per_second": 1000, "burst": 1000}, "lease_seconds": 30,
              "max_attempts": 2, "backoff": {"base_seconds": 0.01, "max_seconds": 0.05}}
    return policies_from({
        "upstreams": {"shop": {"base_url": base_url, "timeout_seconds": 2}},
        "policies": {"coupons": {**policy, "path": "/coupons/{object_id}",
                                 "object_id_case": "insensitive"},
                     "carts": {**policy, "path": "/carts/{object_id}"}}})


async def test_an_upstream_that_ignores_case_gets_one_object_id(
        db_url: str, engine: AsyncEngine, upstream: FakeUpstream) -> None:
    """object_id_case = "insensitive": `ABC` and `abc` are one item, one key and one hold;
    an entry naming no policy must send the lower case; exact policies keep the case."""
    policies = insensitive_policies(upstream.base_url)
    async with LiveServer(test_settings(db_url), policies, db_url) as server, \
            server.client() as live:
        hold = await live.post("/v1/holds", json={
            "tenant_id": "t", "object_ids": ["held"], "reason": "r", "reference": "c"})
        assert hold.status_code == 201, hold.text
        answer = await live.post("/v1/items", json={"items": [
            item("t", "ABC", "coupons"), item("t", "abc", "coupons"),
            item("t", "HELD", "coupons"), item("t", "ABC", "carts")]})
        assert answer.json() == {"inserted": 3, "advanced": 0, "unchanged": 1}, answer.text
        for refused in (
                await live.post("/v1/holds", json={"tenant_id": "t", "object_ids": ["ABC"],
                                                   "reason": "r", "reference": "c"}),
                await live.post("/v1/holds", json={"tenant_id": "t", "reason": "r",
                                                   "reference": "c",
                                                   "object_id_prefix": "AB"}),
                await live.get("/v1/evidence", params={"tenant_id": "t", "object_id": "ABC"})):
            assert refused.status_code == 422, refused.text
            [error] = refused.json()["errors"]
            assert error["type"] == "object_id_not_canonical" and "coupons" in error["message"]
        named = await live.post("/v1/holds", json={
            "tenant_id": "t", "policy": "coupons", "object_id_prefix": "Zz", "reason": "r",
            "reference": "c"})
        assert named.status_code == 201 and named.json()["object_id_prefix"] == "zz"
    assert await rows(engine) == [("t", "ABC", "pending", False),
                                  ("t", "abc", "pending", False),
                                  ("t", "held", "pending", True)]
    await run_workers(engine, policies)
    assert sorted(c.path for c in upstream.calls()) == ["/carts/ABC", "/coupons/abc"]


def test_a_store_target_compares_ids_as_its_column_does() -> None:
    with pytest.raises(ConfigError) as refused:
        store_policies("postgresql://store.invalid/shop", object_id_case="insensitive")
    assert "object_id_case" in str(refused.value) and "store" in str(refused.value)
    assert store_policies("postgresql://store.invalid/shop").policies  # "exact" is fine

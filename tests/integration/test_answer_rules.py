"""Answers read from the body, end to end: the worker reads a 200's JSON body over loopback,
the policy's rules decide the outcome, and the ledger records the rule's reason and code
(never the message); a 409 naming the current version is retried at once with it."""

from __future__ import annotations

import json
import random
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.config.policies import Policies
from service.ledger import registration
from service.upstreams.deletion_api import Upstreams
from service.worker.process import database_pool
from tests.conftest import policies_from
from tests.fakes.answer_rules import SHOPIFY
from tests.fakes.upstream import Call, FakeUpstream, Fault
from tests.integration.test_pipeline import PAST, drain, release_all

QUERY = "mutation($id: ID!) { customerDelete(input: {id: $id}) { deletedCustomerId } }"
CONFLICT = {"status": 409, "path": "errors[*].code", "equals": "ConcurrentModification",
            "outcome": "transient", "reason": "conflict", "version": "errors[0].currentVersion"}


def make_policies(port: int, **overrides: Any) -> Policies:
    common: dict[str, Any] = {"version": 1, "upstream": "api", "scope": "{policy}:{tenant_id}",
                              "rate": {"per_second": 1000, "burst": 1000},
                              "lease_seconds": 30, "max_attempts": 3,
                              "backoff": {"base_seconds": 0.01, "max_seconds": 0.02},
                              **overrides}
    return policies_from({
        "upstreams": {"api": {"base_url": f"http://127.0.0.1:{port}", "timeout_seconds": 2}},
        "policies": {
            "graphql": {**common, "method": "POST", "path": "/graphql.json", "answers": SHOPIFY,
                        "body": {"query": QUERY,
                                 "variables": {"id": "gid://shopify/Customer/{object_id}"}}},
            "versioned": {**common, "answers": [CONFLICT],
                          "path": "/customers/{object_id}?version={object_version}"}}})


def for_customer(n: int) -> Any:
    def match(call: Call) -> bool:
        return bool(call.body) and json.loads(call.body)["variables"]["id"].endswith(f"/{n}")
    return match


def graphql_answer(payload: Any) -> dict[str, Any]:
    return {"status": 200, "headers": {"Content-Type": "application/json"},
            "body": json.dumps(payload).encode()}



class MidJitter(random.Random):
    """Backoff's full jitter at its middle: a random draw near 0 would bring a long backoff
    due within the drain (a 600 s ceiling, and the drain polls for seconds), and the tests
    that wait out a backoff would see a second attempt about once in fifty runs."""

    def random(self) -> float:
        return 0.5


async def run(engine: AsyncEngine, policies: Policies, policy: str, ids: list[str]) -> None:
    await registration.register(engine, [registration.Registration("acme", i,
                                                                   policies.policies[policy],
                                                                   PAST) for i in ids])
    await release_all(engine)
    ups = Upstreams(policies.upstreams)
    try:
        await drain(database_pool(engine, policies, ups, concurrency=4, rng=MidJitter()),
                    engine)
    finally:
        await ups.aclose()


async def items(engine: AsyncEngine) -> dict[str, tuple[Any, ...]]:
    async with engine.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT object_id, status, last_outcome, coalesce(dead_reason, last_error), "
            "attempts, object_version FROM items"))).all()
    return {r[0]: tuple(r[1:]) for r in rows}


async def error_codes(engine: AsyncEngine, object_id: str) -> list[tuple[str, str | None]]:
    async with engine.connect() as conn:
        return [tuple(r) for r in (await conn.execute(text(
            "SELECT a.outcome, a.error_code FROM attempts a JOIN items i ON i.id = a.item_id "
            "WHERE i.object_id = :o ORDER BY a.id"), {"o": object_id})).all()]


async def test_a_graphql_answer_is_classified_by_its_body(engine: AsyncEngine,
                                                          upstream: FakeUpstream) -> None:
    deleted = {"data": {"customerDelete": {"deletedCustomerId": "gid://x", "userErrors": []}}}
    upstream.inject(Fault.STATUS, times=None, match=for_customer(1), **graphql_answer(deleted))
    upstream.inject(Fault.STATUS, times=None, match=for_customer(2), **graphql_answer(
        {"data": {"customerDelete": {"deletedCustomerId": None, "userErrors": [
            {"field": ["id"], "message": "Customer has orders"}]}}}))
    upstream.inject(Fault.STATUS, times=1, match=for_customer(3), **graphql_answer(
        {"errors": [{"message": "Throttled", "extensions": {"code": "THROTTLED"}}]}))
    upstream.inject(Fault.STATUS, times=None, match=for_customer(3), **graphql_answer(deleted))
    # a 200 that is not the mutation's answer is no deletion: the catch-all rule retries it
    upstream.inject(Fault.STATUS, times=None, match=for_customer(4), status=200,
                    body=b"<html>maintenance</html>")
    await run(engine, make_policies(upstream.port), "graphql", ["1", "2", "3", "4"])

    got = await items(engine)
    assert got["1"] == ("succeeded", "succeeded", None, 1, None)
    assert got["2"] == ("dead", "permanent", "http_200:user_errors:id", 1, None)
    # throttled by its body: the attempt refunded, then deleted
    assert got["3"] == ("succeeded", "succeeded", None, 1, None)
    # then its success, recorded on the item (no attempt row)
    assert await error_codes(engine, "3") == [("throttled", "http_200:throttled")]
    assert got["4"] == ("dead", "transient", "max_attempts:http_200:no_deletion", 3, None)
    async with engine.connect() as conn:
        recorded = (await conn.execute(text(
            "SELECT string_agg(coalesce(error_code, ''), ' ') FROM attempts"))).scalar_one()
    assert "orders" not in recorded  # the message text is never recorded


async def test_a_body_over_the_cap_is_not_read(engine: AsyncEngine,
                                               upstream: FakeUpstream) -> None:
    deleted = {"data": {"customerDelete": {"deletedCustomerId": "gid://x"}},
               "padding": "x" * 2000}
    upstream.inject(Fault.STATUS, times=None, **graphql_answer(deleted))
    await run(engine, make_policies(upstream.port, answer_max_bytes=1024, max_attempts=1),
              "graphql", ["1"])
    assert (await items(engine))["1"] == ("dead", "transient",
                                          "max_attempts:http_200:no_deletion", 1, None)


async def test_a_conflict_is_retried_at_once_with_the_version_it_names(
        engine: AsyncEngine, upstream: FakeUpstream) -> None:
    conflict = {"statusCode": 409, "message": "Object c-1 has a different version than "
                "expected. Expected: 1 - Actual: 5.",
                "errors": [{"code": "ConcurrentModification", "currentVersion": 5}]}
    upstream.inject(Fault.STATUS, times=1, match=lambda c: "version=1" in c.query,
                    status=409, headers={"Content-Type": "application/json"},
                    body=json.dumps(conflict).encode())
    # a long backoff: only an immediate retry lets the item finish within the drain
    slow = make_policies(upstream.port, backoff={"base_seconds": 600, "max_seconds": 600})
    await run(engine, slow, "versioned", ["c-1"])
    assert (await items(engine))["c-1"] == ("succeeded", "succeeded", None, 2, "5")
    assert [c.query for c in upstream.calls()] == ["version=1", "version=5"]
    assert await error_codes(engine, "c-1") == [("transient", "http_409:conflict")]


async def test_a_conflict_naming_the_version_just_sent_backs_off(
        engine: AsyncEngine, upstream: FakeUpstream) -> None:
    """A concurrent writer keeps the version where it was: retrying at once would spend
    every attempt in seconds, so the item waits out the backoff like any transient."""
    conflict = {"errors": [{"code": "ConcurrentModification", "currentVersion": 1}]}
    upstream.inject(Fault.STATUS, times=None, status=409,
                    headers={"Content-Type": "application/json"},
                    body=json.dumps(conflict).encode())
    slow = make_policies(upstream.port, backoff={"base_seconds": 600, "max_seconds": 600})
    await run(engine, slow, "versioned", ["c-1"])
    status, outcome, reason, attempts, version = (await items(engine))["c-1"]
    assert (status, outcome, attempts) == ("pending", "transient", 1)
    assert reason == "http_409:conflict:same_version" and version is None
    assert len(upstream.calls()) == 1

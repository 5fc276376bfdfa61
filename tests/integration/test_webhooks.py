"""POST /v1/webhooks/{source} on a live server and a real database: deliveries signed by
independent implementations (the Standard Webhooks reference library; Shopify-style and
hex HMACs computed here) are applied once; everything else changes nothing at all."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from standardwebhooks import Webhook

from service.commands.openapi import openapi_document
from service.config.policies import Policies
from service.ledger import registration
from service.observability import metrics
from service.webhooks import deliveries, intake
from service.webhooks.receipts import Receipt
from tests.conftest import (
    LiveServer,
    eventually,
    free_port,
    policies_from,
    test_settings,
    wait_for_lock_waits,
)
from tests.fakes.upstream import FakeUpstream

STD_SECRET = "whsec_" + base64.b64encode(b"standard-secret-0123456789abcdef").decode()
STD_OLD = "whsec_" + base64.b64encode(b"the previous standard secret....").decode()
SHOP_SECRET = "shpss_current_secret"
SHOP_OLD = "shpss_previous_secret"
PLAIN_SECRET = "plain-hmac-secret"
BC_SECRET = "bigcommerce-static-header-secret"
BC_NEXT = "the-next-static-header-secret-0"
ENV = {"STD_NEW": STD_SECRET, "STD_OLD": STD_OLD, "SHOP_NEW": SHOP_SECRET,
       "SHOP_OLD": SHOP_OLD, "PLAIN": PLAIN_SECRET, "BC": BC_SECRET, "BC_NEXT": BC_NEXT}
SHOP = "acme.myshopify.com"
SHOP_LIMIT = 2048


def make_policies(base_url: str = "http://127.0.0.1:9") -> Policies:
    policy = {"version": 1, "upstream": "shop", "scope": "tenant:{tenant_id}",
              "rate": {"per_second": 1000, "burst": 1000}, "lease_seconds": 30,
              "backoff": {"base_seconds": 0.01, "max_seconds": 0.05}}
    shop_rule = {"tenant": "header:X-Shopify-Shop-Domain"}
    return policies_from({
        "upstreams": {"shop": {"base_url": base_url, "timeout_seconds": 2}},
        "policies": {"carts": {**policy, "path": "/carts/{object_id}"},
                     "customers": {**policy, "path": "/customers/{object_id}"},
                     "shops": {**policy, "path": "/shops/{object_id}"}},
        "webhooks": {
            "std": {"scheme": "standard", "secrets_env": ["STD_NEW", "STD_OLD"], "rules": [
                {"topic": "order.cancelled", "policy": "carts", "tenant": "body:data.shop",
                 "object_id": "body:data.id"},
                {"topic": "cart.abandoned", "policy": "carts", "tenant": "body:data.shop",
                 "object_id": "body:data.id", "due": "P1D"}]},
            "shopify": {"scheme": "shopify", "secret_env": "SHOP_NEW",
                        "secrets_env": ["SHOP_OLD"], "max_body_bytes": SHOP_LIMIT, "rules": [
                {**shop_rule, "topic": "orders/cancelled", "policy": "carts",
                 "object_id": "body:id"},
                {**shop_rule, "topic": "customers/redact", "policy": "customers",
                 "object_id": "body:customer.id"},
                {**shop_rule, "topic": "shop/redact", "policy": "shops",
                 "object_id": "body:shop_id", "due": "PT1H"}]},
            "plain": {"scheme": "hmac-sha256", "secret_env": "PLAIN",
                      "signature_header": "X-Signature", "topic_header": "X-Event", "rules": [
                {"topic": "cart.expired", "policy": "carts", "tenant": "body:shop",
                 "object_id": "body:cart"}]},
            # BigCommerce: a static secret in a custom header, the event type in "scope"
            "bigcommerce": {"scheme": "header", "secret_env": "BC", "secrets_env": ["BC_NEXT"],
                            "signature_header": "X-Sweeper-Secret", "topic_path": "scope",
                            "rules": [{"topic": "store/cart/abandoned", "policy": "carts",
                                       "tenant": "body:producer", "object_id": "body:data.id"}]},
        }}, ENV)


def standard(payload: Any, secret: str = STD_SECRET, msg_id: str | None = None,
             ts: float | None = None) -> tuple[bytes, dict[str, str]]:
    body = json.dumps(payload)
    msg_id = msg_id or f"msg_{uuid.uuid4().hex}"
    stamp = datetime.fromtimestamp(time.time() if ts is None else ts, tz=UTC)
    return body.encode(), {"webhook-id": msg_id,
                           "webhook-timestamp": str(int(stamp.timestamp())),
                           "webhook-signature": Webhook(secret).sign(msg_id, stamp, body),
                           "content-type": "application/json"}


def shopify(topic: str, payload: Any, secret: str = SHOP_SECRET, webhook_id: str | None = None,
            raw: bytes | None = None) -> tuple[bytes, dict[str, str]]:
    body = raw if raw is not None else json.dumps(payload).encode()
    digest = hmac.new(secret.encode(), body, hashlib.sha256).digest()
    return body, {"X-Shopify-Hmac-Sha256": base64.b64encode(digest).decode(),
                  "X-Shopify-Topic": topic, "X-Shopify-Shop-Domain": SHOP,
                  "X-Shopify-Webhook-Id": webhook_id or str(uuid.uuid4()),
                  "content-type": "application/json"}


def plain(payload: Any, event: str = "cart.expired") -> tuple[bytes, dict[str, str]]:
    body = json.dumps(payload).encode()
    return body, {"X-Signature": hmac.new(PLAIN_SECRET.encode(), body,
                                          hashlib.sha256).hexdigest(), "X-Event": event}


def bigcommerce(cart: int, secret: str | None = BC_SECRET, scope: str = "store/cart/abandoned"
                ) -> tuple[bytes, dict[str, str]]:
    body = json.dumps({"scope": scope, "store_id": "1025646", "producer": "stores/abc123",
                       "hash": uuid.uuid4().hex, "created_at": 1561479335,
                       "data": {"type": "cart", "id": cart}}).encode()
    return body, {} if secret is None else {"X-Sweeper-Secret": secret}


async def tables(engine: AsyncEngine) -> dict[str, list[tuple[Any, ...]]]:
    """Every row (and its xmin) of the tables a delivery may write."""
    out = {}
    async with engine.connect() as conn:
        for table in ("items", "webhook_receipts", "scopes", "runs", "batches"):
            rows = await conn.execute(text(
                f"SELECT xmin::text AS x, * FROM {table} ORDER BY 2"))
            out[table] = [tuple(r) for r in rows]
    return out


def counted(source: str, result: str, reason: str = "") -> float:
    return metrics.REGISTRY.get_sample_value(
        "sweeper_webhooks_total", {"source": source, "result": result, "reason": reason}) or 0.0


@pytest.fixture
async def hooks(db_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """A client for a live server with the webhook sources above (no bearer token)."""
    async with LiveServer(test_settings(db_url), make_policies(), db_url) as live:
        async with live.client(None) as client:
            yield client


async def post(client: httpx.AsyncClient, source: str, delivery: tuple[bytes, dict[str, str]]
               ) -> httpx.Response:
    body, headers = delivery
    return await client.post(f"/v1/webhooks/{source}", content=body, headers=headers)


def timed(status_class: str) -> float:
    """Requests the request log timed on the webhook route's template."""
    return metrics.REGISTRY.get_sample_value(
        "sweeper_http_request_duration_seconds_count",
        {"route": "/v1/webhooks/{source}", "method": "POST", "status": status_class}) or 0.0


async def test_standard_delivery_releases_the_item_at_once(hooks: httpx.AsyncClient,
                                                          engine: AsyncEngine) -> None:
    before = counted("std", "accepted")
    timed_before = timed("2xx"), timed("4xx")
    answer = await post(hooks, "std", standard(
        {"type": "order.cancelled", "data": {"shop": "acme", "id": 881}}))
    assert answer.status_code == 202, answer.text
    # the gate sends deliveries straight to the endpoint; the request log still labels them
    # by the route's template, and a refusal is problem+json through the app's handlers
    refused = await post(hooks, "std", (b"{}", {"webhook-id": "x"}))
    assert refused.status_code == 401
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.headers["x-request-id"] in refused.json()["instance"]
    assert (timed("2xx"), timed("4xx")) == (timed_before[0] + 1, timed_before[1] + 1)
    doc = answer.json()
    assert doc["result"] == "applied" and doc["duplicate"] is False
    assert len(doc["item_ids"]) == 1
    async with engine.connect() as conn:
        item = (await conn.execute(text(
            "SELECT id, tenant_id, object_id, policy, status, batch_id, operation_key, "
            "released_at IS NOT NULL AND released_at <= now() AS released, "
            "due_at <= now() AS due, next_attempt_at <= now() AS claimable "
            "FROM items"))).one()
        receipt = (await conn.execute(text(
            "SELECT source, webhook_id, event_type, result, item_ids FROM webhook_receipts"
        ))).one()
        scope = (await conn.execute(text("SELECT name, rate_per_second FROM scopes"))).one()
    assert (item.tenant_id, item.object_id, item.policy, item.status) == (
        "acme", "881", "carts", "pending")
    assert item.batch_id is None and item.released and item.due and item.claimable
    assert item.operation_key == registration.operation_key("acme", "881", "carts", 1)
    assert tuple(receipt) == ("std", answer.request.headers["webhook-id"], "order.cancelled",
                              "applied", [item.id])
    assert tuple(scope) == ("tenant:acme", 1000.0)
    assert counted("std", "accepted") == before + 1


async def test_rotation_accepts_every_configured_secret(hooks: httpx.AsyncClient,
                                                        engine: AsyncEngine) -> None:
    for secret in (STD_SECRET, STD_OLD):
        answer = await post(hooks, "std", standard(
            {"type": "order.cancelled", "data": {"shop": "acme", "id": secret[-8:]}}, secret))
        assert answer.status_code == 202, answer.text
    for secret in (SHOP_SECRET, SHOP_OLD):
        answer = await post(hooks, "shopify", shopify("orders/cancelled",
                                                      {"id": len(secret)}, secret))
        assert answer.status_code == 202, answer.text
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM items"))).scalar() == 4


def _forgeries() -> list[tuple[str, str, Any]]:
    order = {"type": "order.cancelled", "data": {"shop": "acme", "id": 1}}

    def forged() -> tuple[bytes, dict[str, str]]:
        body, headers = standard(order)
        return body.replace(b'"id": 1', b'"id": 2'), headers

    def truncated() -> tuple[bytes, dict[str, str]]:
        body, headers = standard(order)
        return body[:-1], headers

    def unsigned() -> tuple[bytes, dict[str, str]]:
        body, headers = standard(order)
        del headers["webhook-signature"]
        return body, headers

    def shop_forged() -> tuple[bytes, dict[str, str]]:
        _, headers = shopify("orders/cancelled", {"id": 1})
        return b'{"id": 2}', headers

    def plain_truncated() -> tuple[bytes, dict[str, str]]:
        body, headers = plain({"shop": "acme", "cart": "c1"})
        return body[:10], headers

    return [
        ("std", "forged body", forged),
        ("std", "truncated body", truncated),
        ("std", "wrong secret", lambda: standard(order, "whsec_" + base64.b64encode(
            b"somebody else's secret").decode())),
        ("std", "stale timestamp", lambda: standard(order, ts=time.time() - 301)),
        ("std", "future timestamp", lambda: standard(order, ts=time.time() + 301)),
        ("std", "no signature", unsigned),
        ("shopify", "wrong secret", lambda: shopify("orders/cancelled", {"id": 1}, "nope")),
        ("shopify", "forged body", shop_forged),
        ("plain", "truncated body", plain_truncated),
    ]


async def test_forgeries_are_refused_alike_with_zero_writes(hooks: httpx.AsyncClient,
                                                            engine: AsyncEngine) -> None:
    await post(hooks, "std", standard({"type": "order.cancelled",
                                       "data": {"shop": "acme", "id": 1}}))
    before = await tables(engine)
    refused_before = {(s, r): counted(s, "rejected", r) for s in ("std", "shopify", "plain")
                      for r in ("signature", "timestamp")}
    bodies = set()
    for source, case, make in _forgeries():
        answer = await post(hooks, source, make())
        assert answer.status_code == 401, (case, answer.text)
        assert answer.headers["content-type"] == "application/problem+json"
        doc = answer.json()
        doc.pop("instance")
        bodies.add(json.dumps(doc, sort_keys=True))
    assert len(bodies) == 1, "a 401 must not say which part failed"
    assert await tables(engine) == before
    assert counted("std", "rejected", "timestamp") == refused_before["std", "timestamp"] + 2
    assert counted("std", "rejected", "signature") == refused_before["std", "signature"] + 4
    assert counted("shopify", "rejected", "signature") == refused_before[
        "shopify", "signature"] + 2


async def test_replay_is_a_duplicate_with_the_original_answer(hooks: httpx.AsyncClient,
                                                              engine: AsyncEngine) -> None:
    delivery = shopify("customers/redact", {"shop_id": 7, "customer": {"id": 42}})
    first = await post(hooks, "shopify", delivery)
    assert first.status_code == 202, first.text
    after_first = await tables(engine)
    dup_before = counted("shopify", "duplicate")
    for _ in range(2):
        again = await post(hooks, "shopify", delivery)
        assert again.status_code == 200
        assert again.json() == {**first.json(), "duplicate": True}
    assert await tables(engine) == after_first
    assert counted("shopify", "duplicate") == dup_before + 2

    ignored = shopify("products/update", {"id": 3})
    ignored_before = counted("shopify", "ignored", "no-rule")
    answers = [await post(hooks, "shopify", ignored) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200]
    assert [a.json()["result"] for a in answers] == ["ignored", "ignored"]
    assert [a.json()["duplicate"] for a in answers] == [False, True]
    assert counted("shopify", "ignored", "no-rule") == ignored_before + 1
    async with engine.connect() as conn:
        results = (await conn.execute(text(
            "SELECT result, item_ids FROM webhook_receipts ORDER BY id"))).all()
    assert [tuple(r) for r in results] == [("applied", first.json()["item_ids"]),
                                           ("ignored", [])]


async def test_bad_bodies_get_their_4xx_and_write_nothing(hooks: httpx.AsyncClient,
                                                          engine: AsyncEngine) -> None:
    before = await tables(engine)
    too_big = b'{"id": "' + b"x" * SHOP_LIMIT + b'"}'

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(SHOP_LIMIT // 256 + 2):
            yield b" " * 256

    _, chunk_headers = shopify("orders/cancelled", None, raw=b"")
    streamed = await hooks.post("/v1/webhooks/shopify", content=chunks(),
                                headers=chunk_headers)
    assert streamed.status_code == 413, streamed.text
    assert "content-length" not in streamed.request.headers
    cases = [
        ("shopify", shopify("orders/cancelled", None, raw=too_big), 413),
        ("shopify", shopify("orders/cancelled", None, raw=b'{"id": 1'), 400),
        ("shopify", shopify("orders/cancelled", None, raw=b"\xff\xfe{}"), 400),
        ("shopify", shopify("orders/cancelled", None, raw=b"[" * 100_0 + b"]" * 100_0), 400),
        ("shopify", shopify("orders/cancelled", {"no_id": 1}), 422),
        ("shopify", shopify("orders/cancelled", {"id": True}), 422),
        ("shopify", shopify("orders/cancelled", {"id": "a\nb"}), 422),
        ("shopify", shopify("customers/redact", {"customer": None}), 422),
        ("std", standard(["not", "an", "object"]), 400),
        ("std", standard({"type": 5}), 400),
        ("plain", plain({"shop": "acme", "cart": "c1"}, event=""), 400),
    ]
    no_id = shopify("orders/cancelled", {"id": 1})
    del no_id[1]["X-Shopify-Webhook-Id"]
    cases.append(("shopify", no_id, 400))
    bad_id = shopify("orders/cancelled", {"id": 1}, webhook_id="has space")
    cases.append(("shopify", bad_id, 400))
    for source, delivery, status in cases:
        answer = await post(hooks, source, delivery)
        assert answer.status_code == status, (delivery[0][:40], answer.text)
        assert answer.headers["content-type"] == "application/problem+json"
        assert "xxxx" not in answer.text
    missing = await post(hooks, "nosuch", shopify("orders/cancelled", {"id": 1}))
    assert missing.status_code == 404
    assert await tables(engine) == before


async def test_plain_hmac_deduplicates_on_the_body_digest(hooks: httpx.AsyncClient,
                                                          engine: AsyncEngine) -> None:
    one = plain({"shop": "acme", "cart": "c1"})
    first, again = [await post(hooks, "plain", one) for _ in range(2)]
    other = await post(hooks, "plain", plain({"shop": "acme", "cart": "c2"}))
    assert [first.status_code, again.status_code, other.status_code] == [202, 200, 202]
    assert first.json()["webhook_id"] == "sha256:" + hashlib.sha256(one[0]).hexdigest()
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM items"))).scalar() == 2


async def test_a_static_header_secret_is_checked_in_full(hooks: httpx.AsyncClient,
                                                         engine: AsyncEngine) -> None:
    """The `header` scheme: either configured secret is accepted, anything else (missing,
    a prefix, another case, the secret plus a byte) is the same 401 with nothing written;
    the event type comes from the body's `topic_path`."""
    accepted = [await post(hooks, "bigcommerce", bigcommerce(n, secret))
                for n, secret in ((1, BC_SECRET), (2, BC_NEXT))]
    assert [a.status_code for a in accepted] == [202, 202], accepted[0].text
    before = await tables(engine)
    refused = before_refused = counted("bigcommerce", "rejected", "signature")
    for secret in (None, "", BC_SECRET[:-1], BC_SECRET.upper(), BC_SECRET + "x", PLAIN_SECRET):
        answer = await post(hooks, "bigcommerce", bigcommerce(3, secret))
        assert answer.status_code == 401, (secret, answer.text)
        refused += 1
    assert counted("bigcommerce", "rejected", "signature") == refused == before_refused + 6
    assert await tables(engine) == before
    ignored = await post(hooks, "bigcommerce", bigcommerce(4, scope="store/order/created"))
    assert (ignored.status_code, ignored.json()["result"]) == (200, "ignored")
    async with engine.connect() as conn:
        rows = (await conn.execute(text("SELECT tenant_id, object_id FROM items "
                                        "ORDER BY object_id"))).all()
    assert [tuple(r) for r in rows] == [("stores/abc123", "1"), ("stores/abc123", "2")]


async def test_a_hint_never_postpones(hooks: httpx.AsyncClient, engine: AsyncEngine) -> None:
    pol = make_policies().policies["carts"]
    due = datetime.now(UTC) - timedelta(hours=1)
    await registration.register(engine, [registration.Registration("acme", "early", pol, due)])
    before = await tables(engine)
    answer = await post(hooks, "std", standard(
        {"type": "cart.abandoned", "data": {"shop": "acme", "id": "early"}}))
    assert answer.status_code == 202 and answer.json()["item_ids"] == []
    after = await tables(engine)
    assert after["items"] == before["items"]
    assert len(after["webhook_receipts"]) == 1

    # a later due date advances an item due later still, without releasing it
    far = datetime.now(UTC) + timedelta(days=30)
    await registration.register(engine, [registration.Registration("acme", "late", pol, far)])
    answer = await post(hooks, "std", standard(
        {"type": "cart.abandoned", "data": {"shop": "acme", "id": "late"}}))
    assert len(answer.json()["item_ids"]) == 1
    async with engine.connect() as conn:
        row = (await conn.execute(text(
            "SELECT due_at, released_at FROM items WHERE object_id = 'late'"))).one()
    assert row.released_at is None
    assert timedelta(hours=23) < row.due_at - datetime.now(UTC) < timedelta(hours=25)


async def test_finished_items_are_left_alone(hooks: httpx.AsyncClient,
                                             engine: AsyncEngine) -> None:
    pol = make_policies().policies["carts"]
    await registration.register(engine, [registration.Registration(SHOP, "9", pol,
                                                                   datetime.now(UTC))])
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE items SET status = 'cancelled', completed_at = now()"))
    before = await tables(engine)
    answer = await post(hooks, "shopify", shopify("orders/cancelled", {"id": 9}))
    assert answer.status_code == 202 and answer.json()["item_ids"] == []
    assert (await tables(engine))["items"] == before["items"]


async def test_concurrent_duplicates_have_one_effect(hooks: httpx.AsyncClient,
                                                     engine: AsyncEngine) -> None:
    pol = make_policies().policies["carts"]
    await registration.register(engine, [registration.Registration(SHOP, "77", pol,
                                                       datetime.now(UTC) + timedelta(days=9))])
    delivery = shopify("orders/cancelled", {"id": 77})
    answers = await asyncio.gather(*(post(hooks, "shopify", delivery) for _ in range(12)))
    assert sorted(a.status_code for a in answers) == [200] * 11 + [202]
    assert len({json.dumps(a.json()["item_ids"]) for a in answers}) == 1
    async with engine.connect() as conn:
        receipt = (await conn.execute(text(
            "SELECT xmin::text AS x, item_ids FROM webhook_receipts"))).one()
        item = (await conn.execute(text(
            "SELECT xmin::text AS x, id, released_at FROM items"))).one()
    # the item was last written by the transaction that wrote the receipt, and only then
    assert receipt.item_ids == [item.id] and item.x == receipt.x
    assert item.released_at is not None


def verified(policies: Policies, delivery: tuple[bytes, dict[str, str]]) -> deliveries.Delivery:
    """A delivery as the route hands it to the intake: read and verified."""
    body, headers = delivery
    return deliveries.read_delivery(policies.webhooks["shopify"], policies,
                                  {k.lower(): v for k, v in headers.items()}, body,
                                    now_s=time.time())


async def hold_receipt(conn: AsyncConnection, webhook_id: str,
                       item_ids: tuple[int, ...] = ()) -> None:
    """An uncommitted receipt of `webhook_id`: the intake's insert of it waits on `conn`."""
    await conn.execute(text(
        "INSERT INTO webhook_receipts (source, webhook_id, event_type, result, item_ids) "
        "VALUES ('shopify', :id, 'orders/cancelled', 'applied', :items)"),
        {"id": webhook_id, "items": list(item_ids)})


async def test_losing_a_race_rolls_the_effect_back(db_url: str, engine: AsyncEngine) -> None:
    """A delivery that finds no receipt, but whose id is committed by another transaction
    while it runs, answers with the winner's receipt and leaves no trace of its own."""
    policies = make_policies()
    delivery = verified(policies, shopify("orders/cancelled", {"id": 5}))
    box = intake.Intake()
    try:
        async with engine.connect() as winner:
            await hold_receipt(winner, delivery.webhook_id, (123,))
            loser = asyncio.create_task(box.apply(engine.url, test_settings(db_url), delivery))
            # the loser's insert waits on the receipt's unique index, for the winner's commit
            await wait_for_lock_waits(engine, 1)
            assert not loser.done()
            await winner.commit()
            receipt = await loser
    finally:
        await box.aclose()
    assert receipt == Receipt(result="applied", item_ids=(123,), duplicate=True)
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM items"))).scalar() == 0
        assert (await conn.execute(text("SELECT count(*) FROM scopes"))).scalar() == 0


async def test_deliveries_that_wait_together_commit_together_as_if_one_by_one(
        db_url: str, engine: AsyncEngine) -> None:
    """With the intake's one connection busy, the deliveries that queue behind it go in one
    statement and one transaction, and each answers what it would have applied alone: two
    hints at one item, or two deliveries of one id, are never in the same statement."""
    policies = make_policies()
    settings = test_settings(db_url, webhook_db_pool_size=1)
    box = intake.Intake()

    def apply(delivery: deliveries.Delivery) -> asyncio.Task[Receipt]:
        return asyncio.create_task(box.apply(engine.url, settings, delivery))

    try:
        earlier = await apply(verified(policies, shopify("orders/cancelled", {"id": 1},
                                                         webhook_id="w-earlier")))
        async with engine.connect() as blocker:
            await hold_receipt(blocker, "w-first")
            first = apply(verified(policies, shopify("orders/cancelled", {"id": 2},
                                                     webhook_id="w-first")))
            await wait_for_lock_waits(engine, 1)
            fresh = [apply(verified(policies, shopify("orders/cancelled", {"id": 100 + i},
                                                      webhook_id=f"w-fresh-{i}")))
                     for i in range(8)]
            same_item = [apply(verified(policies, shopify("orders/cancelled", {"id": 200},
                                                          webhook_id=f"w-item-{i}")))
                         for i in range(2)]
            twice = [apply(verified(policies, shopify("orders/cancelled", {"id": 300},
                                                      webhook_id="w-twice")))
                     for _ in range(2)]
            replay = apply(verified(policies, shopify("orders/cancelled", {"id": 1},
                                                      webhook_id="w-earlier")))
            behind = (*fresh, *same_item, *twice, replay)
            await eventually(lambda: box.queued == len(behind),
                             "every one queued behind the held statement")
            assert not any(t.done() for t in (first, *behind))
            await blocker.rollback()
        receipts = await asyncio.gather(first, *fresh, *same_item, *twice, replay)
    finally:
        await box.aclose()

    async with engine.connect() as conn:
        items = dict((await conn.execute(text(
            "SELECT object_id, id FROM items WHERE released_at IS NOT NULL"))).all())
        xmins = dict((await conn.execute(text(
            "SELECT webhook_id, xmin::text FROM webhook_receipts"))).all())
    assert set(items) == {"1", "2", "200", "300", *(str(100 + i) for i in range(8))}
    first_r, fresh_r = receipts[0], receipts[1:9]
    (item_a, item_b), (twice_a, twice_b), replay_r = receipts[9:11], receipts[11:13], receipts[13]
    assert first_r == Receipt("applied", (items["2"],), duplicate=False, released=1)
    assert fresh_r == [Receipt("applied", (items[str(100 + i)],), duplicate=False,
                               released=1) for i in range(8)]
    # the second hint at item 200 found it due and released already: it changed nothing
    assert item_a.item_ids == (items["200"],) and item_b.item_ids == ()
    assert not item_a.duplicate and not item_b.duplicate
    assert twice_a == Receipt("applied", (items["300"],), duplicate=False, released=1)
    assert twice_b == Receipt("applied", (items["300"],), duplicate=True)
    assert replay_r == Receipt("applied", (items["1"],), duplicate=True)
    assert earlier == Receipt("applied", (items["1"],), duplicate=False, released=1)
    # what queued behind the held statement went in one transaction, except the second
    # hint at item 200 and the second delivery of w-twice, which waited for the next
    grouped = {xmins[f"w-fresh-{i}"] for i in range(8)} | {xmins["w-item-0"], xmins["w-twice"]}
    assert len(grouped) == 1 and xmins["w-item-1"] not in grouped
    assert len(xmins) == 13


@pytest.mark.parametrize("spoiler", ["refused", "raced"])
async def test_a_group_that_fails_goes_again_one_by_one(db_url: str, engine: AsyncEngine,
                                                         spoiler: str) -> None:
    """A delivery the ledger refuses in a group, or a webhook id another replica commits
    while the group's statement runs, fails that statement (nothing of it written); each of
    its deliveries then goes alone: the refused one alone is refused, the raced one answers
    with the winner's receipt, the others are applied."""
    policies = make_policies()
    settings = test_settings(db_url, webhook_db_pool_size=1)
    box = intake.Intake()

    def apply(delivery: tuple[bytes, dict[str, str]]) -> asyncio.Task[Receipt]:
        return asyncio.create_task(box.apply(engine.url, settings, verified(policies, delivery)))

    try:
        async with engine.connect() as blocker, engine.connect() as winner:
            await hold_receipt(blocker, "w-first")
            first = apply(shopify("orders/cancelled", {"id": 1}, webhook_id="w-first"))
            await wait_for_lock_waits(engine, 1)
            good = [apply(shopify("orders/cancelled", {"id": 10 + i}, webhook_id=f"w-good-{i}"))
                    for i in range(3)]
            if spoiler == "refused":
                long_shop = shopify("orders/cancelled", {"id": 9}, webhook_id="w-spoiler")
                long_shop[1]["X-Shopify-Shop-Domain"] = "s" * 510  # its scope is too long
                spoiled = apply(long_shop)
            else:
                spoiled = apply(shopify("orders/cancelled", {"id": 20}, webhook_id="w-spoiler"))
                await hold_receipt(winner, "w-spoiler", (123,))
            await eventually(lambda: box.queued == len(good) + 1,
                             "all queued behind the held statement")
            await blocker.rollback()
            # committed first: until then its backend may still show the lock wait it had,
            # and the wait below would take it for the group's
            assert (await first).item_ids
            if spoiler == "raced":
                # the group (3 good and the raced one) waits on the winner's receipt
                await wait_for_lock_waits(engine, 1)
                assert not any(g.done() for g in good)
                await winner.commit()
            assert [len((await g).item_ids) for g in good] == [1, 1, 1]
            if spoiler == "refused":
                with pytest.raises(deliveries.DeliveryRejected) as caught:
                    await spoiled
                assert caught.value.reason == "unmappable"
            else:
                assert await spoiled == Receipt("applied", (123,), duplicate=True)
    finally:
        await box.aclose()
    async with engine.connect() as conn:
        objects = (await conn.execute(text("SELECT object_id FROM items ORDER BY 1"))).scalars()
        assert list(objects) == ["1", "10", "11", "12"]
        receipts = (await conn.execute(text(
            "SELECT webhook_id, xmin::text FROM webhook_receipts ORDER BY 1"))).all()
    assert [r[0] for r in receipts] == [
        "w-first", "w-good-0", "w-good-1", "w-good-2", *(["w-spoiler"] if spoiler == "raced"
                                                          else [])]
    # the good ones went again one by one: a transaction each
    assert len({r[1] for r in receipts if r[0].startswith("w-good")}) == 3


async def test_a_statement_the_database_gives_up_on_is_a_503(db_url: str,
                                                             engine: AsyncEngine) -> None:
    """The statement timeout cutting a delivery's wait on a lock wrote nothing: 503 with
    Retry-After, and the same delivery sent again is applied."""
    delivery = shopify("orders/cancelled", {"id": 1})
    settings = test_settings(db_url, db_statement_timeout_ms=300)
    async with LiveServer(settings, make_policies(), db_url) as live, \
            live.client(None) as client:
        before = counted("shopify", "rejected", "overloaded")
        async with engine.connect() as blocker:
            await hold_receipt(blocker, delivery[1]["X-Shopify-Webhook-Id"])
            refused = await post(client, "shopify", delivery)
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "2"
            assert refused.json()["type"] == "urn:sweeper:problem:webhook-intake-closed"
            await blocker.rollback()
        assert counted("shopify", "rejected", "overloaded") == before + 1
        assert (await post(client, "shopify", delivery)).status_code == 202


async def test_intake_limit_answers_503_with_retry_after(db_url: str,
                                                         engine: AsyncEngine) -> None:
    """The in-flight slot is held by verified deliveries only: one waiting on the database
    fills a limit of 1, while unsigned and slow senders never take it."""
    settings = test_settings(db_url, webhook_max_in_flight=1)
    body, headers = shopify("orders/cancelled", {"id": 1})
    slow_delivery, slow_headers = shopify("orders/cancelled", {"id": 3})
    gate = asyncio.Event()

    async def slow_body() -> AsyncIterator[bytes]:
        yield slow_delivery[:4]
        await gate.wait()
        yield slow_delivery[4:]

    async with LiveServer(settings, make_policies(), db_url) as live, \
            live.client(None) as client, \
            engine.connect() as blocker:
        before = counted("shopify", "rejected", "overloaded")
        # a slow sender and unsigned probes hold no slot: a verified delivery still goes in
        slow = asyncio.create_task(client.post("/v1/webhooks/shopify", content=slow_body(),
                                               headers=slow_headers))
        for _ in range(5):
            assert (await client.post("/v1/webhooks/shopify", content=b"{}")).status_code == 401
        assert (await post(client, "shopify", shopify("orders/cancelled", {"id": 4}))
                ).status_code == 202
        # the receipt of the held delivery's id, uncommitted: its insert waits on it
        await blocker.execute(text(
            "INSERT INTO webhook_receipts (source, webhook_id, event_type, result, item_ids) "
            "VALUES ('shopify', :id, 'orders/cancelled', 'applied', '{}')"),
            {"id": headers["X-Shopify-Webhook-Id"]})
        held = asyncio.create_task(client.post("/v1/webhooks/shopify", content=body,
                                               headers=headers))
        await wait_for_lock_waits(engine, 1)
        refused = await post(client, "shopify", shopify("orders/cancelled", {"id": 2}))
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "2"
        assert refused.json()["type"] == "urn:sweeper:problem:webhook-intake-closed"
        await blocker.rollback()
        assert (await held).status_code == 202
        assert (await post(client, "shopify", shopify("orders/cancelled", {"id": 2}))
                ).status_code == 202
        gate.set()
        assert (await slow).status_code == 202
    assert counted("shopify", "rejected", "overloaded") == before + 1
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM items"))).scalar() == 4



async def listening(engine: AsyncEngine) -> bool:
    """Whether a session of this database has LISTENed (its last statement, as asyncpg's
    add_listener leaves it until the listener's first probe, LISTEN_PROBE_INTERVAL_S on)."""
    async with engine.connect() as conn:
        return bool((await conn.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND query LIKE 'LISTEN %'"))).scalar_one())


async def item_status(engine: AsyncEngine, status: str) -> bool:
    async with engine.connect() as conn:
        return (await conn.execute(text("SELECT status FROM items"))).scalar() == status


async def test_hint_drains_through_the_workers_without_a_run(db_url: str,
                                                             engine: AsyncEngine) -> None:
    async with FakeUpstream() as upstream:
        policies = make_policies(upstream.base_url)
        pol = policies.policies["customers"]
        far = datetime.now(UTC) + timedelta(days=30)
        await registration.register(engine, [registration.Registration(SHOP, "42", pol, far)])
        settings = test_settings(db_url, workers=2)
        async with LiveServer(settings, policies, db_url) as live:
            async with live.client(None) as client:
                # the pool found nothing to claim and listens for releases
                await eventually(lambda: listening(engine), "the workers' LISTEN")
                answer = await post(client, "shopify", shopify(
                    "customers/redact", {"shop_id": 1, "customer": {"id": 42}}))
                assert answer.status_code == 202, answer.text
                await eventually(lambda: item_status(engine, "succeeded"), "the hint drained")
        calls = upstream.calls()
        assert [c.path for c in calls] == ["/customers/42"]
        assert calls[0].idempotency_key == registration.operation_key(SHOP, "42", "customers", 1)
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM runs"))).scalar() == 0
        item = (await conn.execute(text("SELECT id, due_at FROM items"))).one()
    assert item.due_at < far and answer.json()["item_ids"] == [item.id]


async def test_releases_wake_the_workers_after_the_commit(hooks: httpx.AsyncClient,
                                                          db_url: str) -> None:
    listener = await asyncpg.connect(db_url)
    heard: asyncio.Queue[str] = asyncio.Queue()
    await listener.add_listener("sweeper_released", lambda *args: heard.put_nowait(args[2]))
    try:
        later = await post(hooks, "std", standard(
            {"type": "cart.abandoned", "data": {"shop": "acme", "id": "later"}}))
        assert later.status_code == 202
        now = await post(hooks, "std", standard(
            {"type": "order.cancelled", "data": {"shop": "acme", "id": "now"}}))
        assert now.status_code == 202
        async with asyncio.timeout(5):
            await heard.get()
        # the notification came after the commit: the released item is there to claim
        released = await listener.fetchval(
            "SELECT count(*) FROM items WHERE released_at IS NOT NULL")
        assert released == 1
    finally:
        await listener.close()


async def test_ids_the_ledger_refuses_are_a_422(hooks: httpx.AsyncClient,
                                                engine: AsyncEngine) -> None:
    before = await tables(engine)
    long_shop = shopify("orders/cancelled", {"id": 1})
    long_shop[1]["X-Shopify-Shop-Domain"] = "s" * 510  # a valid id, but its scope is not
    answer = await post(hooks, "shopify", long_shop)
    assert answer.status_code == 422, answer.text
    assert answer.json()["type"] == "urn:sweeper:problem:unmappable-webhook"
    assert await tables(engine) == before


async def test_an_unreachable_database_is_a_503(db_url: str) -> None:
    closed = f"postgresql://postgres@127.0.0.1:{free_port()}/nowhere"
    async with LiveServer(test_settings(closed), make_policies(), closed) as live:
        async with live.client(None, timeout=20) as client:
            before = counted("shopify", "rejected", "unavailable")
            answer = await post(client, "shopify", shopify("orders/cancelled", {"id": 1}))
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] == "2"
    assert answer.json()["type"] == "urn:sweeper:problem:database-unavailable"
    assert counted("shopify", "rejected", "unavailable") == before + 1


def test_the_contract_declares_every_webhook_answer() -> None:
    """Each error status below is answered by a test above (forgeries 401, bad bodies 400,
    413 and 422, a body too slow 408 (test_hostile_input.py), unknown source 404, intake
    limit and database outage 503), always as
    problem+json; the contract declares exactly those, with that media type."""
    operation = openapi_document()["paths"]["/v1/webhooks/{source}"]["post"]
    responses = operation["responses"]
    assert {int(s) for s in responses if int(s) >= 400} == {400, 401, 404, 408, 413, 422, 503}
    for status in ("400", "401", "404", "408", "413", "422", "503"):
        assert list(responses[status]["content"]) == ["application/problem+json"], status
    assert "Retry-After" in responses["503"]["headers"]
    assert {"200", "202"} <= set(responses)
    assert operation["requestBody"]["content"]["application/json"]["examples"]

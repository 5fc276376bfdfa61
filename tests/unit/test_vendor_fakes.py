"""Tests of the vendor fakes themselves (drills/vendors), over real loopback HTTP."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from drills.vendors import VendorFake
from drills.vendors.bigcommerce import FakeBigCommerce
from drills.vendors.commercetools import FakeCommercetools
from drills.vendors.serve import serve, serve_in_thread
from drills.vendors.shopify import INVALID_TOKEN, FakeShopify
from drills.vendors.stripe import FakeStripe
from service.protocols.egress import public_roots
from tests.conftest import eventually

SHOP_A, SHOP_B, NO_SHOP = "127.0.0.2", "127.0.0.3", "127.0.0.4"
TOKEN_A, TOKEN_B = "shpat_aaaaaaaa", "shpat_bbbbbbbb"
MUTATION = ("mutation customerDelete($input: CustomerDeleteInput!) { customerDelete(input: "
            "$input) { deletedCustomerId userErrors { field message } } }")
BC_TOKEN = "bc-token-1"
STRIPE_KEY = "sk_test_51AbCdEfGhIjKlMnOp"
CT_TOKEN = "ct-token-1"


def gid(n: int) -> str:
    return f"gid://shopify/Customer/{n}"


def graphql_url(host: str, port: int) -> str:
    return f"http://{host}:{port}/admin/api/2025-01/graphql.json"


async def shopify_delete(client: httpx.AsyncClient, host: str, port: int, customer: str,
                         token: str = TOKEN_A) -> httpx.Response:
    return await client.post(graphql_url(host, port),
                             json={"query": MUTATION, "variables": {"input": {"id": customer}}},
                             headers={"X-Shopify-Access-Token": token})


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=5.0, verify=public_roots()) as c:
        yield c


# --------------------------------------------------------------------------- Shopify
@pytest.fixture
async def shopify() -> AsyncIterator[tuple[FakeShopify, int]]:
    fake = FakeShopify()
    fake.add_shop(SHOP_A, TOKEN_A)
    fake.add_shop(SHOP_B, TOKEN_B)
    fake.add_customers(SHOP_A, [1, 2, 3])
    fake.add_customers(SHOP_B, [1])
    async with serve(fake, hosts=(SHOP_A, SHOP_B, NO_SHOP)) as port:
        yield fake, port


async def test_shopify_deletes_and_reports_cost(
        shopify: tuple[FakeShopify, int], client: httpx.AsyncClient) -> None:
    fake, port = shopify
    r = await shopify_delete(client, SHOP_A, port, gid(1))
    assert r.status_code == 200
    body = r.json()
    assert body["data"] == {"customerDelete": {"deletedCustomerId": gid(1), "userErrors": []}}
    assert body["extensions"]["cost"] == {
        "requestedQueryCost": 10, "actualQueryCost": 10,
        "throttleStatus": {"maximumAvailable": 2000.0, "currentlyAvailable": 1990,
                           "restoreRate": 100.0}}
    assert fake.customers(SHOP_A) == {gid(2), gid(3)}
    [call] = fake.calls
    assert (call.method, call.tenant, call.status, call.outcome) == ("POST", SHOP_A, 200, "ok")
    assert call.body["variables"] == {"input": {"id": gid(1)}}
    assert TOKEN_A not in repr(fake.calls)


async def test_shopify_missing_customer_is_a_user_error(
        shopify: tuple[FakeShopify, int], client: httpx.AsyncClient) -> None:
    fake, port = shopify
    r = await shopify_delete(client, SHOP_A, port, gid(99))
    assert r.status_code == 200
    assert r.json()["data"]["customerDelete"] == {
        "deletedCustomerId": None,
        "userErrors": [{"field": ["id"], "message": "Customer can't be found"}]}
    assert fake.outcomes["not_found"] == 1


async def test_shopify_variables_id_and_inline_literal_are_accepted(
        shopify: tuple[FakeShopify, int], client: httpx.AsyncClient) -> None:
    fake, port = shopify
    doc_style = ("mutation customerDelete($id: ID!) { customerDelete(input: {id: $id}) "
                 "{ deletedCustomerId userErrors { field message } } }")
    r = await client.post(graphql_url(SHOP_A, port),
                          json={"query": doc_style, "variables": {"id": gid(2)}},
                          headers={"X-Shopify-Access-Token": TOKEN_A})
    assert r.json()["data"]["customerDelete"]["deletedCustomerId"] == gid(2)
    literal = f'mutation {{ customerDelete(input: {{id: "{gid(3)}"}}) {{ deletedCustomerId }} }}'
    r = await client.post(graphql_url(SHOP_A, port), content=literal,
                          headers={"X-Shopify-Access-Token": TOKEN_A,
                                   "Content-Type": "application/graphql"})
    assert r.json()["data"]["customerDelete"]["deletedCustomerId"] == gid(3)
    assert fake.customers(SHOP_A) == {gid(1)}


async def test_shopify_bad_token_and_unknown_shop(
        shopify: tuple[FakeShopify, int], client: httpx.AsyncClient) -> None:
    fake, port = shopify
    for token in ("wrong", ""):
        r = await shopify_delete(client, SHOP_A, port, gid(1), token=token)
        assert (r.status_code, r.json()) == (401, {"errors": INVALID_TOKEN})
    r = await shopify_delete(client, NO_SHOP, port, gid(1))
    assert r.status_code == 404
    assert fake.customers(SHOP_A) == {gid(1), gid(2), gid(3)}
    assert fake.outcomes["unauthorized"] == 2


async def test_shopify_bad_bodies(
        shopify: tuple[FakeShopify, int], client: httpx.AsyncClient) -> None:
    fake, port = shopify
    headers = {"X-Shopify-Access-Token": TOKEN_A, "Content-Type": "application/json"}
    missing = {"errors": {"query": "Required parameter missing or invalid"}}
    for content in (b"{not json", b'{"variables": {}}', b'{"query": ""}'):
        r = await client.post(graphql_url(SHOP_A, port), content=content, headers=headers)
        assert (r.status_code, r.json()) == (400, missing)
    before = fake.available(SHOP_A)
    for variables in ({"input": {"id": "42"}}, {}):
        r = await client.post(graphql_url(SHOP_A, port),
                              json={"query": MUTATION, "variables": variables}, headers=headers)
        assert r.status_code == 200
        assert "data" not in r.json() and r.json()["errors"][0]["message"].startswith(
            "Variable $input")
    assert fake.available(SHOP_A) >= before  # a rejected variable costs nothing
    assert fake.spent == []


async def test_shopify_bucket_throttles_then_recovers(
        shopify: tuple[FakeShopify, int], client: httpx.AsyncClient) -> None:
    fake, port = shopify
    fake.set_limits(SHOP_A, maximum_available=30, restore_rate=20, currently_available=30)
    for n in (1, 2, 3):
        r = await shopify_delete(client, SHOP_A, port, gid(n))
        assert r.json()["data"]["customerDelete"]["deletedCustomerId"] == gid(n)
    fake.add_customers(SHOP_A, [4])
    r = await shopify_delete(client, SHOP_A, port, gid(4))
    assert r.status_code == 200
    body = r.json()
    assert body["errors"] == [{"message": "Throttled", "extensions": {
        "code": "THROTTLED", "documentation": "https://shopify.dev/api/usage/rate-limits"}}]
    cost = body["extensions"]["cost"]
    assert (cost["requestedQueryCost"], cost["actualQueryCost"]) == (10, None)
    assert cost["throttleStatus"]["currentlyAvailable"] < 10
    assert cost["throttleStatus"]["maximumAvailable"] == 30.0
    assert fake.throttled == 1 and fake.customers(SHOP_A) == {gid(4)}
    await asyncio.sleep(0.55)  # 20 points/s: 10 points back
    r = await shopify_delete(client, SHOP_A, port, gid(4))
    assert r.json()["data"]["customerDelete"]["deletedCustomerId"] == gid(4)
    assert [s.points for s in fake.spent] == [10, 10, 10, 10]
    assert fake.points_spent(0, time.monotonic() + 1, SHOP_A) == 40


async def test_shopify_refunds_the_unused_cost(
        shopify: tuple[FakeShopify, int], client: httpx.AsyncClient) -> None:
    fake, port = shopify
    fake.set_costs(requested=10, actual=10, actual_not_found=1)
    fake.set_limits(SHOP_A, maximum_available=100, restore_rate=0.01, currently_available=100)
    r = await shopify_delete(client, SHOP_A, port, gid(99))
    cost = r.json()["extensions"]["cost"]
    assert (cost["requestedQueryCost"], cost["actualQueryCost"]) == (10, 1)
    assert cost["throttleStatus"]["currentlyAvailable"] == 99
    r = await shopify_delete(client, SHOP_A, port, gid(1))
    assert r.json()["extensions"]["cost"]["throttleStatus"]["currentlyAvailable"] == 89
    assert [(s.points, s.shop) for s in fake.spent] == [(1, SHOP_A), (10, SHOP_A)]
    # only the requested cost must be available: 9 points refuse a call that would cost 1
    fake.set_limits(SHOP_A, currently_available=9)
    r = await shopify_delete(client, SHOP_A, port, gid(99))
    assert r.json()["errors"][0]["extensions"]["code"] == "THROTTLED"


async def test_shopify_shops_by_host_share_one_port(
        shopify: tuple[FakeShopify, int], client: httpx.AsyncClient) -> None:
    fake, port = shopify
    fake.set_limits(SHOP_A, maximum_available=10, restore_rate=0.01, currently_available=10)
    assert (await shopify_delete(client, SHOP_B, port, gid(1), TOKEN_A)).status_code == 401
    r = await shopify_delete(client, SHOP_B, port, gid(1), TOKEN_B)
    assert r.json()["data"]["customerDelete"]["deletedCustomerId"] == gid(1)
    r = await shopify_delete(client, SHOP_A, port, gid(1), TOKEN_A)
    assert r.json()["data"]["customerDelete"]["deletedCustomerId"] == gid(1)
    # each shop has its own bucket: A's is now empty, B's is not
    r = await shopify_delete(client, SHOP_A, port, gid(2), TOKEN_A)
    assert r.json()["errors"][0]["extensions"]["code"] == "THROTTLED"
    r = await shopify_delete(client, SHOP_B, port, gid(9), TOKEN_B)
    assert r.json()["data"]["customerDelete"]["userErrors"]
    assert fake.customers(SHOP_A) == {gid(2), gid(3)} and fake.customers(SHOP_B) == set()
    assert [c.tenant for c in fake.calls] == [SHOP_B, SHOP_B, SHOP_A, SHOP_A, SHOP_B]


# --------------------------------------------------------------------------- BigCommerce
@pytest.fixture
async def bigcommerce() -> AsyncIterator[tuple[FakeBigCommerce, httpx.AsyncClient]]:
    fake = FakeBigCommerce()
    fake.add_store("abc123", BC_TOKEN)
    fake.add_store("other9", "bc-token-2")
    fake.add_customers("abc123", [1, 2, 3, 4, 5])
    async with serve(fake) as port, httpx.AsyncClient(verify=public_roots(),
            base_url=f"http://127.0.0.1:{port}", timeout=5.0,
            headers={"X-Auth-Token": BC_TOKEN}) as c:
        yield fake, c


def bc_error(status: int, title: str, errors: dict[str, str] | None = None) -> dict[str, Any]:
    return {"status": status, "title": title, "errors": errors or {},
            "type": "https://developer.bigcommerce.com/api-docs/getting-started/api-status-codes"}


async def test_bigcommerce_bulk_delete(
        bigcommerce: tuple[FakeBigCommerce, httpx.AsyncClient]) -> None:
    fake, c = bigcommerce
    r = await c.delete("/stores/abc123/v3/customers", params={"id:in": "1,2,99"})
    assert (r.status_code, r.content) == (204, b"")
    assert fake.customers("abc123") == {3, 4, 5}
    r = await c.delete("/stores/abc123/v3/customers?id%3Ain=98,99")  # encoded key, none exist
    assert r.status_code == 204
    r = await c.delete("/stores/abc123/v3/customers")  # documented: no query, no change
    assert r.status_code == 204
    assert fake.customers("abc123") == {3, 4, 5}
    assert [(d.store, d.requested, d.deleted) for d in fake.deletions] == [
        ("abc123", (1, 2, 99), (1, 2)), ("abc123", (98, 99), ())]
    assert fake.ids_deleted == 2
    assert [c.outcome for c in fake.calls] == ["ok", "not_found", "ok"]


async def test_bigcommerce_malformed_ids(
        bigcommerce: tuple[FakeBigCommerce, httpx.AsyncClient]) -> None:
    fake, c = bigcommerce
    for value, bad in (("1,x", "x"), ("", ""), ("3,,4", ""), ("-1", "-1")):
        r = await c.delete("/stores/abc123/v3/customers", params={"id:in": value})
        assert r.status_code == 422
        assert r.json() == bc_error(422, "The filter(s): id:in are not valid.",
                                    {"id:in": f"'{bad}' is not an integer"})
    fake.max_ids_per_call = 2
    r = await c.delete("/stores/abc123/v3/customers", params={"id:in": "3,4,5"})
    assert r.status_code == 413 and r.json()["status"] == 413
    assert fake.customers("abc123") == {1, 2, 3, 4, 5}


async def test_bigcommerce_bad_token(
        bigcommerce: tuple[FakeBigCommerce, httpx.AsyncClient]) -> None:
    fake, c = bigcommerce
    for store, token in (("abc123", "wrong"), ("abc123", "bc-token-2"), ("nostore", BC_TOKEN)):
        r = await c.delete(f"/stores/{store}/v3/customers", params={"id:in": "1"},
                           headers={"X-Auth-Token": token})
        assert (r.status_code, r.json()) == (401, bc_error(401, "Unauthorized"))
        assert "X-Rate-Limit-Requests-Left" not in r.headers
    assert fake.customers("abc123") == {1, 2, 3, 4, 5}
    assert BC_TOKEN not in repr(fake.calls)


async def test_bigcommerce_quota_window(
        bigcommerce: tuple[FakeBigCommerce, httpx.AsyncClient]) -> None:
    fake, c = bigcommerce
    fake.set_limits("abc123", quota=3, window_s=0.3)
    lefts = []
    for n in (1, 2, 3):
        r = await c.delete("/stores/abc123/v3/customers", params={"id:in": str(n)})
        assert r.status_code == 204
        assert r.headers["X-Rate-Limit-Time-Window-Ms"] == "300"
        assert r.headers["X-Rate-Limit-Requests-Quota"] == "3"
        assert 0 < int(r.headers["X-Rate-Limit-Time-Reset-Ms"]) <= 300
        lefts.append(r.headers["X-Rate-Limit-Requests-Left"])
    assert lefts == ["2", "1", "0"]
    r = await c.delete("/stores/abc123/v3/customers", params={"id:in": "4"})
    assert (r.status_code, r.json()) == (429, bc_error(429, "Too Many Requests"))
    assert r.headers["X-Rate-Limit-Requests-Left"] == "0"
    assert r.headers["X-Retry-After"] == "1"
    reset_ms = int(r.headers["X-Rate-Limit-Time-Reset-Ms"])
    assert 0 <= reset_ms <= 300
    assert fake.throttled == 1 and 4 in fake.customers("abc123")
    await asyncio.sleep(reset_ms / 1000 + 0.02)
    r = await c.delete("/stores/abc123/v3/customers", params={"id:in": "4"})
    assert r.status_code == 204 and r.headers["X-Rate-Limit-Requests-Left"] == "2"
    # the other store's quota is its own
    fake.add_customers("other9", [7])
    r = await c.delete("/stores/other9/v3/customers", params={"id:in": "7"},
                       headers={"X-Auth-Token": "bc-token-2"})
    assert r.headers["X-Rate-Limit-Requests-Left"] == "149"


# --------------------------------------------------------------------------- Stripe
@pytest.fixture
async def stripe() -> AsyncIterator[tuple[FakeStripe, httpx.AsyncClient]]:
    fake = FakeStripe()
    fake.add_account("acct_1", STRIPE_KEY)
    fake.add_customers("acct_1", ["cus_1", "cus_2", "cus_3"])
    async with serve(fake) as port, httpx.AsyncClient(verify=public_roots(),
            base_url=f"http://127.0.0.1:{port}", timeout=5.0,
            headers={"Authorization": f"Bearer {STRIPE_KEY}"}) as c:
        yield fake, c


async def test_stripe_delete_and_missing(stripe: tuple[FakeStripe, httpx.AsyncClient]) -> None:
    fake, c = stripe
    r = await c.delete("/v1/customers/cus_1")
    assert (r.status_code, r.json()) == (
        200, {"id": "cus_1", "object": "customer", "deleted": True})
    assert r.headers["Request-Id"].startswith("req_")
    r = await c.delete("/v1/customers/cus_1")
    assert (r.status_code, r.json()) == (404, {"error": {
        "type": "invalid_request_error", "code": "resource_missing", "param": "id",
        "message": "No such customer: 'cus_1'",
        "doc_url": "https://stripe.com/docs/error-codes/resource-missing"}})
    assert fake.customers("acct_1") == {"cus_2", "cus_3"}
    assert [(c.tenant, c.outcome) for c in fake.calls] == [("acct_1", "ok"),
                                                           ("acct_1", "not_found")]


async def test_stripe_authentication(stripe: tuple[FakeStripe, httpx.AsyncClient]) -> None:
    fake, c = stripe
    r = await c.delete("/v1/customers/cus_1", headers={"Authorization": ""},
                       auth=(STRIPE_KEY, ""))  # HTTP basic, the key as user name
    assert r.status_code == 200
    r = await c.delete("/v1/customers/cus_2",
                       headers={"Authorization": "Bearer sk_test_wrongkey1234"})
    assert r.status_code == 401
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"] == "Invalid API Key provided: sk_test_********1234"
    assert r.headers["WWW-Authenticate"] == 'Basic realm="Stripe"'
    r = await c.delete("/v1/customers/cus_2", headers={"Authorization": ""})
    assert r.status_code == 401
    assert r.json()["error"]["message"].startswith("You did not provide an API key.")
    assert fake.customers("acct_1") == {"cus_2", "cus_3"}
    assert STRIPE_KEY not in repr(fake.calls)


async def test_stripe_rate_limit(stripe: tuple[FakeStripe, httpx.AsyncClient]) -> None:
    fake, c = stripe
    fake.set_rate_limit("acct_1", per_second=5, burst=2)
    assert (await c.delete("/v1/customers/cus_1")).status_code == 200
    assert (await c.delete("/v1/customers/cus_2")).status_code == 200
    r = await c.delete("/v1/customers/cus_3")
    assert r.status_code == 429
    assert r.json() == {"error": {
        "type": "invalid_request_error", "code": "rate_limit",
        "message": "Too many requests hit the API too quickly. We recommend an exponential "
                   "backoff of your requests.",
        "doc_url": "https://stripe.com/docs/error-codes/rate-limit"}}
    assert r.headers["Stripe-Rate-Limited-Reason"] == "global-rate"
    assert "cus_3" in fake.customers("acct_1") and fake.throttled == 1
    await asyncio.sleep(0.25)  # 5/s: one request's worth back
    assert (await c.delete("/v1/customers/cus_3")).status_code == 200


async def test_stripe_ignores_idempotency_keys_on_delete_as_documented(
        stripe: tuple[FakeStripe, httpx.AsyncClient]) -> None:
    fake, c = stripe
    key = {"Idempotency-Key": "k-1"}
    assert (await c.delete("/v1/customers/cus_1", headers=key)).status_code == 200
    r = await c.delete("/v1/customers/cus_1", headers=key)
    assert r.status_code == 404 and "Idempotent-Replayed" not in r.headers
    assert [c.idempotency_key for c in fake.calls] == ["k-1", "k-1"]


async def test_stripe_idempotent_replay(stripe: tuple[FakeStripe, httpx.AsyncClient]) -> None:
    fake, c = stripe
    fake.idempotent_deletes = True
    key = {"Idempotency-Key": "k-1"}
    first = await c.delete("/v1/customers/cus_1", headers=key)
    again = await c.delete("/v1/customers/cus_1", headers=key)
    assert (again.status_code, again.content) == (200, first.content)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first.headers
    r = await c.delete("/v1/customers/cus_2", headers=key)  # same key, other request
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "idempotency_error"
    assert "cus_2" in fake.customers("acct_1")
    # an answered 500 is saved and replayed too; a throttled call is not saved
    fake.fail_next(1, 500)
    r = await c.delete("/v1/customers/cus_2", headers={"Idempotency-Key": "k-2"})
    assert (r.status_code, r.json()["error"]["type"]) == (500, "api_error")
    r = await c.delete("/v1/customers/cus_2", headers={"Idempotency-Key": "k-2"})
    assert r.status_code == 500 and r.headers["Idempotent-Replayed"] == "true"
    fake.set_rate_limit("acct_1", per_second=0.5, burst=1)
    assert (await c.delete("/v1/customers/cus_3", headers={"Idempotency-Key": "x"})
            ).status_code == 200
    assert (await c.delete("/v1/customers/cus_2", headers={"Idempotency-Key": "k-3"})
            ).status_code == 429
    fake.set_rate_limit("acct_1", None)
    r = await c.delete("/v1/customers/cus_2", headers={"Idempotency-Key": "k-3"})
    assert r.status_code == 200 and "Idempotent-Replayed" not in r.headers
    assert [c.outcome for c in fake.calls] == [
        "ok", "replayed", "invalid", "fault", "replayed", "ok", "throttled", "ok"]


async def test_stripe_idempotency_key_in_flight_and_pruned(
        stripe: tuple[FakeStripe, httpx.AsyncClient]) -> None:
    fake, c = stripe
    fake.idempotent_deletes = True
    fake.idempotency_ttl_s = 0.3
    key = {"Idempotency-Key": "k-1"}
    fake.slow_next(1, delay=0.5)  # longer than the next request takes to arrive
    slow = asyncio.create_task(c.delete("/v1/customers/cus_1", headers=key))
    # in its delay, which Stripe's fake takes after saving the key as in progress
    await eventually(lambda: fake.delaying == 1, "the first request in progress")
    r = await c.delete("/v1/customers/cus_1", headers=key)
    assert r.status_code == 409 and r.json()["error"]["code"] == "idempotency_key_in_use"
    assert (await slow).status_code == 200
    await asyncio.sleep(0.35)  # past the fake's TTL on its own clock: the key is pruned
    r = await c.delete("/v1/customers/cus_1", headers=key)
    assert r.status_code == 404 and "Idempotent-Replayed" not in r.headers


# --------------------------------------------------------------------------- commercetools
@pytest.fixture
async def commercetools() -> AsyncIterator[tuple[FakeCommercetools, httpx.AsyncClient]]:
    fake = FakeCommercetools()
    fake.add_project("shop-eu", CT_TOKEN)
    fake.add_project("shop-us", "ct-token-2")
    fake.add_customers("shop-eu", ["c1", "c2"])
    fake.add_customers("shop-eu", ["c3"], version=4)
    async with serve(fake) as port, httpx.AsyncClient(verify=public_roots(),
            base_url=f"http://127.0.0.1:{port}", timeout=5.0,
            headers={"Authorization": f"Bearer {CT_TOKEN}"}) as c:
        yield fake, c


def ct_error(status: int, code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"statusCode": status, "message": message,
            "errors": [{"code": code, "message": message, **extra}]}


async def test_commercetools_delete_with_version(
        commercetools: tuple[FakeCommercetools, httpx.AsyncClient]) -> None:
    fake, c = commercetools
    r = await c.delete("/shop-eu/customers/c3", params={"version": 4})
    assert r.status_code == 200
    assert (r.json()["id"], r.json()["version"]) == ("c3", 4)
    r = await c.delete("/shop-eu/customers/c3", params={"version": 4})
    assert (r.status_code, r.json()) == (404, ct_error(
        404, "ResourceNotFound", "The Resource with ID 'c3' was not found."))
    assert fake.customers("shop-eu") == {"c1": 1, "c2": 1}


async def test_commercetools_stale_version_is_a_conflict(
        commercetools: tuple[FakeCommercetools, httpx.AsyncClient]) -> None:
    fake, c = commercetools
    assert fake.bump_version("shop-eu", "c1") == 2
    r = await c.delete("/shop-eu/customers/c1", params={"version": 1})
    message = "Object c1 has a different version than expected. Expected: 1 - Actual: 2."
    assert (r.status_code, r.json()) == (409, ct_error(
        409, "ConcurrentModification", message, currentVersion=2))
    assert fake.version("shop-eu", "c1") == 2
    r = await c.delete("/shop-eu/customers/c1", params={"version": 2})
    assert r.status_code == 200 and fake.version("shop-eu", "c1") is None
    assert [c.outcome for c in fake.calls] == ["conflict", "ok"]


async def test_commercetools_version_parameter_is_required(
        commercetools: tuple[FakeCommercetools, httpx.AsyncClient]) -> None:
    fake, c = commercetools
    r = await c.delete("/shop-eu/customers/c1")
    assert (r.status_code, r.json()) == (400, ct_error(400, "InvalidInput",
                                                       "Missing version number"))
    r = await c.delete("/shop-eu/customers/c1", params={"version": "one"})
    assert r.status_code == 400 and r.json()["errors"][0]["code"] == "InvalidInput"
    assert fake.customers("shop-eu")["c1"] == 1


async def test_commercetools_bad_token(
        commercetools: tuple[FakeCommercetools, httpx.AsyncClient]) -> None:
    fake, c = commercetools
    invalid = {"statusCode": 401, "message": "invalid_token", "error": "invalid_token",
               "errors": [{"code": "invalid_token", "message": "invalid_token"}]}
    for project, auth in (("shop-eu", "Bearer nope"), ("shop-eu", "Bearer ct-token-2"),
                          ("shop-eu", ""), ("nope", f"Bearer {CT_TOKEN}")):
        r = await c.delete(f"/{project}/customers/c1", params={"version": 1},
                           headers={"Authorization": auth})
        assert (r.status_code, r.json()) == (401, invalid)
    assert fake.customers("shop-eu")["c1"] == 1
    assert CT_TOKEN not in repr(fake.calls)


async def test_commercetools_rate_limit_off_by_default_then_429_or_503(
        commercetools: tuple[FakeCommercetools, httpx.AsyncClient]) -> None:
    fake, c = commercetools
    statuses = [(await c.delete(f"/shop-eu/customers/x{n}", params={"version": 1})).status_code
                for n in range(30)]
    assert statuses == [404] * 30
    fake.set_rate_limit("shop-eu", per_second=4, burst=1)
    assert (await c.delete("/shop-eu/customers/c1", params={"version": 1})).status_code == 200
    r = await c.delete("/shop-eu/customers/c2", params={"version": 1})
    assert r.status_code == 429 and r.json()["statusCode"] == 429
    fake.set_rate_limit("shop-eu", per_second=4, burst=1, status=503)
    assert (await c.delete("/shop-eu/customers/c2", params={"version": 1})).status_code == 200
    r = await c.delete("/shop-eu/customers/x", params={"version": 1})
    assert r.status_code == 503 and r.json()["errors"][0]["code"] == "OverCapacity"
    await asyncio.sleep(0.3)
    assert (await c.delete("/shop-eu/customers/x", params={"version": 1})).status_code == 404
    assert fake.throttled == 2


# --------------------------------------------------------------------------- all four
Send = Callable[[httpx.AsyncClient, int], Awaitable[httpx.Response]]


def _vendor(name: str) -> tuple[VendorFake, Send, Callable[[int], Any]]:
    """A fake with one tenant, a request that succeeds on it, and its error body for a
    status."""
    if name == "shopify":
        shopify = FakeShopify()
        shopify.add_shop("127.0.0.1", TOKEN_A)
        shopify.add_customers("127.0.0.1", [1])

        async def send_shopify(c: httpx.AsyncClient, port: int) -> httpx.Response:
            return await shopify_delete(c, "127.0.0.1", port, gid(1))

        return shopify, send_shopify, lambda s: {"errors": {
            500: "Internal Server Error", 503: "Service Unavailable"}[s]}
    if name == "bigcommerce":
        bc = FakeBigCommerce()
        bc.add_store("abc123", BC_TOKEN)
        bc.add_customers("abc123", [1])

        async def send_bc(c: httpx.AsyncClient, port: int) -> httpx.Response:
            return await c.delete(f"http://127.0.0.1:{port}/stores/abc123/v3/customers",
                                  params={"id:in": "1"}, headers={"X-Auth-Token": BC_TOKEN})

        return bc, send_bc, lambda s: bc_error(
            s, {500: "Internal Server Error", 503: "Service Unavailable"}[s])
    if name == "stripe":
        stripe = FakeStripe()
        stripe.add_account("acct_1", STRIPE_KEY)
        stripe.add_customers("acct_1", ["cus_1"])

        async def send_stripe(c: httpx.AsyncClient, port: int) -> httpx.Response:
            return await c.delete(f"http://127.0.0.1:{port}/v1/customers/cus_1",
                                  headers={"Authorization": f"Bearer {STRIPE_KEY}"})

        return stripe, send_stripe, lambda s: {"error": {
            "type": "api_error", "message": "An unknown error occurred"}}
    ct = FakeCommercetools()
    ct.add_project("shop-eu", CT_TOKEN)
    ct.add_customers("shop-eu", ["c1"])

    async def send_ct(c: httpx.AsyncClient, port: int) -> httpx.Response:
        return await c.delete(f"http://127.0.0.1:{port}/shop-eu/customers/c1",
                              params={"version": 1},
                              headers={"Authorization": f"Bearer {CT_TOKEN}"})

    return ct, send_ct, lambda s: {
        500: ct_error(500, "General", "An unexpected error occurred."),
        503: ct_error(503, "OverCapacity", "Service is over capacity. Please retry later.")}[s]


VENDORS = ["shopify", "bigcommerce", "stripe", "commercetools"]


@pytest.mark.parametrize("name", VENDORS)
async def test_injected_failures_then_normal_answers(
        name: str, client: httpx.AsyncClient) -> None:
    fake, send, error_body = _vendor(name)
    fake.fail_next(2, 503)
    fake.fail_next(1, 500)
    async with serve(fake) as port:
        answers = [await send(client, port) for _ in range(4)]
    assert [r.status_code for r in answers[:3]] == [503, 503, 500]
    assert [r.json() for r in answers[:3]] == [error_body(503), error_body(503), error_body(500)]
    assert answers[3].status_code in (200, 204)
    assert [c.outcome for c in fake.calls] == ["fault", "fault", "fault", "ok"]
    assert fake.statuses[503] == 2 and fake.statuses[500] == 1


@pytest.mark.parametrize("name", VENDORS)
async def test_slow_answers(name: str, client: httpx.AsyncClient) -> None:
    fake, send, _ = _vendor(name)
    fake.slow_next(1, delay=0.2)
    async with serve(fake) as port:
        started = time.monotonic()
        r = await send(client, port)
        assert time.monotonic() - started >= 0.2
        assert r.status_code in (200, 204)
        started = time.monotonic()
        await send(client, port)
        assert time.monotonic() - started < 0.2


# --------------------------------------------------------------------------- serving
async def test_serve_stops_cleanly(client: httpx.AsyncClient) -> None:
    fake = FakeCommercetools()
    async with serve(fake) as port:
        assert (await client.delete(f"http://127.0.0.1:{port}/p/customers/x")).status_code == 401
    with pytest.raises(httpx.ConnectError):
        await client.delete(f"http://127.0.0.1:{port}/p/customers/x")


def test_serve_in_thread() -> None:
    fake = FakeStripe()
    fake.add_account("acct_1", STRIPE_KEY)
    fake.add_customers("acct_1", ["cus_1"])
    with serve_in_thread(fake, hosts=("127.0.0.1", "127.0.0.5")) as port:
        for host in ("127.0.0.1", "127.0.0.5"):
            r = httpx.delete(f"http://{host}:{port}/v1/customers/cus_1",
                             headers={"Authorization": f"Bearer {STRIPE_KEY}"})
            assert r.status_code == (200 if host == "127.0.0.1" else 404)
    assert fake.statuses == {200: 1, 404: 1}
    with pytest.raises(httpx.ConnectError):
        httpx.delete(f"http://127.0.0.1:{port}/v1/customers/cus_1")

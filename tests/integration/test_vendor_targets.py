"""The vendor examples of policies.example.toml, end to end: each block as written (only its
base URL pointed at the vendor's fake on loopback, and a shop's host pattern at loopback
addresses) drives the real worker against a fake that follows the vendor's documentation,
with per-tenant credentials from a directory or the write-only API. A tenant without a
credential waits, its scope paused `no-credential`, and resumes when the credential arrives.
"""

from __future__ import annotations

import asyncio
import base64
import tomllib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from drills.vendors import example_block
from drills.vendors.bigcommerce import FakeBigCommerce
from drills.vendors.commercetools import FakeCommercetools
from drills.vendors.serve import serve
from drills.vendors.shopify import FakeShopify
from drills.vendors.stripe import FakeStripe
from service.budget import scope_controls
from service.budget.credential_waits import Credentials, resume_arrived
from service.config.policies import Policies
from service.credentials import CredentialStore, Keyring, tenant_credentials
from service.credentials.directory import RECHECK_S, DirectorySource
from service.ledger import registration
from service.upstreams.deletion_api import Upstreams
from service.worker.process import database_pool
from tests.conftest import REPO_ROOT, LiveServer, policies_from, test_settings
from tests.fakes.clock import ManualClock
from tests.integration.test_pipeline import PAST, release_all

EXAMPLE = REPO_ROOT / "policies.example.toml"
KEY = bytes(range(32))
SHOPS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


def vendor_block(name: str) -> dict[str, Any]:
    """The commented `# >>> name` ... `# <<<` block of the example file, uncommented."""
    return tomllib.loads(example_block(EXAMPLE, name))


def on_loopback(name: str, base_url: str, **upstream: Any) -> Policies:
    doc = vendor_block(name)
    [up] = doc["upstreams"].values()
    up.update(base_url=base_url, **upstream)
    return policies_from(doc)


async def drain(engine: AsyncEngine, policies: Policies, credentials: Credentials,
                done: Callable[[dict[str, int]], bool], timeout_s: float = 20) -> None:
    """Run a pool until `done(statuses)`."""
    ups = Upstreams(policies.upstreams)
    pool = database_pool(engine, policies, ups, concurrency=8, credentials=credentials)
    try:
        async with asyncio.timeout(timeout_s):
            while not done(await statuses(engine)):
                await pool.run_once()
                await asyncio.sleep(0.02)
                await pool.flush()
            await pool.drain()
    finally:
        await pool.drain()
        await ups.aclose()


async def statuses(engine: AsyncEngine) -> dict[str, int]:
    async with engine.connect() as conn:
        return dict((await conn.execute(text(
            "SELECT status, count(*) FROM items GROUP BY status"))).all())


async def items_of(engine: AsyncEngine) -> dict[tuple[str, str], tuple[Any, ...]]:
    async with engine.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT tenant_id, object_id, status, coalesce(dead_reason, last_error), attempts "
            "FROM items"))).all()
    return {(r[0], r[1]): tuple(r[2:]) for r in rows}


async def scope_pause(engine: AsyncEngine, scope: str) -> tuple[bool, str | None]:
    async with engine.connect() as conn:
        row = (await conn.execute(text("SELECT paused, paused_reason FROM scopes WHERE name = :n"),
                                  {"n": scope})).one()
    return row[0], row[1]


async def register(engine: AsyncEngine, policies: Policies, pairs: list[tuple[str, str]]
                   ) -> None:
    [policy] = policies.policies.values()
    await registration.register(engine, [registration.Registration(t, o, policy, PAST) for t,
                                         o in pairs])
    await release_all(engine)


def settled(expected: int) -> Callable[[dict[str, int]], bool]:
    return lambda s: s.get("succeeded", 0) + s.get("dead", 0) >= expected


@pytest.fixture
async def shopify() -> AsyncIterator[tuple[FakeShopify, int]]:
    fake = FakeShopify()
    for n, shop in enumerate(SHOPS):
        fake.add_shop(shop, f"shpat_{n}")
    async with serve(fake, hosts=SHOPS) as port:
        yield fake, port


async def test_shopify_per_shop_hosts_tokens_and_answers(
        engine: AsyncEngine, shopify: tuple[FakeShopify, int], tmp_path: Path) -> None:
    fake, port = shopify
    fake.add_customers(SHOPS[0], [1, 2])
    fake.add_customers(SHOPS[1], [3])
    fake.add_customers(SHOPS[2], [5])
    (tmp_path / SHOPS[0]).write_text("shpat_0\n")  # a Secret's file: one trailing newline
    (tmp_path / SHOPS[1]).write_text("shpat_1")
    policies = on_loopback("shopify", f"http://{{tenant_id}}:{port}/admin/api/2025-10",
                           host_pattern=r"127\.0\.0\.[0-9]+", allow_private_addresses=True,
                           credentials={"directory": str(tmp_path)})
    # the directory as Credentials.of reads it, its once-a-second re-read on a test clock
    clock = ManualClock()
    [upstream] = policies.upstreams
    credentials = Credentials({upstream: DirectorySource(tmp_path, clock=clock)})
    # customer 99 does not exist: Shopify's userErrors say so, which counts as deleted
    await register(engine, policies, [(SHOPS[0], "1"), (SHOPS[0], "2"), (SHOPS[1], "3"),
                                      (SHOPS[1], "99"), (SHOPS[2], "5")])
    await drain(engine, policies, credentials, settled(4))

    got = await items_of(engine)
    for key in [(SHOPS[0], "1"), (SHOPS[0], "2"), (SHOPS[1], "3"), (SHOPS[1], "99")]:
        assert got[key] == ("succeeded", None, 1), key
    assert fake.customers(SHOPS[0]) == set() and fake.customers(SHOPS[1]) == set()
    # the shop without a credential was never called: it waits, unpunished
    assert got[(SHOPS[2], "5")] == ("pending", "no_credential", 0)
    assert await scope_pause(engine, f"shopify:{SHOPS[2]}") == (True, "no-credential")
    assert {c.tenant for c in fake.calls} == {SHOPS[0], SHOPS[1]}
    assert all(c.status == 200 for c in fake.calls)

    (tmp_path / SHOPS[2]).write_text("shpat_2")
    clock.advance(RECHECK_S)  # the directory is re-read at most once a RECHECK_S
    assert await resume_arrived(engine, policies, credentials) == [f"shopify:{SHOPS[2]}"]
    await drain(engine, policies, credentials, settled(5))
    assert (await items_of(engine))[(SHOPS[2], "5")] == ("succeeded", None, 1)
    assert fake.customers(SHOPS[2]) == set()


@pytest.mark.slow  # the scope stays closed until the shop's bucket refills (seconds)
async def test_shopify_throttled_in_a_200_is_retried_not_lost(
        engine: AsyncEngine, shopify: tuple[FakeShopify, int], tmp_path: Path) -> None:
    fake, port = shopify
    # a nearly empty bucket: the first calls meet THROTTLED answers, which close the scope
    fake.set_limits(SHOPS[0], maximum_available=30, restore_rate=100,
                    currently_available=0)
    fake.add_customers(SHOPS[0], range(1, 21))
    (tmp_path / SHOPS[0]).write_text("shpat_0")
    policies = on_loopback("shopify", f"http://{{tenant_id}}:{port}/admin/api/2025-10",
                           host_pattern=r"127\.0\.0\.[0-9]+", allow_private_addresses=True,
                           credentials={"directory": str(tmp_path)})
    doc_policy = policies.policies["shopify-customer-redact"]
    assert doc_policy.config.rate.unit == "points"
    await register(engine, policies, [(SHOPS[0], str(i)) for i in range(1, 21)])
    await drain(engine, policies, Credentials.of(policies, engine, None), settled(20))
    assert await statuses(engine) == {"succeeded": 20}
    assert fake.customers(SHOPS[0]) == set()
    assert fake.throttled >= 1
    async with engine.connect() as conn:
        throttled = (await conn.execute(text(
            "SELECT count(*) FROM attempts WHERE outcome = 'throttled' "
            "AND error_code = 'http_200:throttled'"))).scalar_one()
    assert throttled == fake.throttled


async def test_shopify_cost_refunds_and_the_shops_view_reach_the_shared_bucket(
        engine: AsyncEngine, shopify: tuple[FakeShopify, int], tmp_path: Path) -> None:
    """Each answer's actualQueryCost refunds what the call did not spend, and the shop's
    currentlyAvailable lowers the bucket every replica draws from."""
    fake, port = shopify
    fake.set_costs(requested=10, actual=4)
    # the shop restores 1 point/s, so its view stays near 300 - 40 however slow the drain
    fake.set_limits(SHOPS[0], maximum_available=2000, restore_rate=1,
                    currently_available=300)
    fake.add_customers(SHOPS[0], range(1, 11))
    (tmp_path / SHOPS[0]).write_text("shpat_0")
    policies = on_loopback("shopify", f"http://{{tenant_id}}:{port}/admin/api/2025-10",
                           host_pattern=r"127\.0\.0\.[0-9]+", allow_private_addresses=True,
                           credentials={"directory": str(tmp_path)})
    await register(engine, policies, [(SHOPS[0], str(i)) for i in range(1, 11)])
    async with engine.begin() as conn:  # a full bucket: 100 calls of 10 points
        await conn.execute(text("UPDATE scopes SET tokens = 100, refilled_at = now()"))
    await drain(engine, policies, Credentials.of(policies, engine, None), settled(10))
    assert await statuses(engine) == {"succeeded": 10} and fake.throttled == 0
    async with engine.connect() as conn:
        tokens = (await conn.execute(text(
            "SELECT tokens FROM scopes WHERE name = :n"), {"n": f"shopify:{SHOPS[0]}"})
        ).scalar_one()
    # the shop said about 300 - 10 x 4 points were left: 26 calls' worth, not 100 - 10
    # (each call refunded 0.6 of its 1.0, which the shop's lower view then capped)
    assert 20 <= tokens <= 30


@pytest.mark.slow  # the refused scope stays held here for LOCAL_HOLD_S (1 s) after it
async def test_stripe_credentials_through_the_api(db_url: str, engine: AsyncEngine) -> None:
    fake = FakeStripe(per_second=None)
    fake.add_account("acct_a", "sk_test_a")
    fake.add_account("acct_b", "sk_test_b")
    fake.add_customers("acct_a", ["cus_1", "cus_2"])
    fake.add_customers("acct_b", ["cus_3"])
    async with serve(fake) as port:
        policies = on_loopback("stripe", f"http://127.0.0.1:{port}")
        settings = test_settings(db_url, workers=2,
                                 credentials_key=base64.b64encode(KEY).decode())
        async with LiveServer(settings, policies, db_url) as live, live.client() as api:
            put = await api.put("/v1/tenants/acct_a/credentials/stripe",
                                json={"secret": "sk_test_a"})
            assert put.status_code == 200, put.text
            items = [{"tenant_id": t, "object_id": o, "policy": "stripe-customers",
                      "due_at": "2026-01-01T00:00:00Z"}
                     for t, o in [("acct_a", "cus_1"), ("acct_a", "cus_2"),
                                  ("acct_a", "cus_gone"), ("acct_b", "cus_3")]]
            assert (await api.post("/v1/items", json={"items": items})).status_code == 200
            assert (await api.post("/v1/runs", json={})).status_code == 202
            async with asyncio.timeout(20):
                while (await statuses(engine)).get("succeeded", 0) < 3 or \
                        await scope_pause(engine, "stripe:acct_b") != (True, "no-credential"):
                    await asyncio.sleep(0.05)
            # the credential arrives: the replica that took it resumes the scope at once
            put = await api.put("/v1/tenants/acct_b/credentials/stripe",
                                json={"secret": "sk_test_b"})
            assert put.status_code == 200, put.text
            assert "sk_test_b" not in put.text
            assert await scope_pause(engine, "stripe:acct_b") == (False, None)
            async with asyncio.timeout(20):
                while (await statuses(engine)).get("succeeded", 0) < 4:
                    await asyncio.sleep(0.05)
    assert fake.customers("acct_a") == set() and fake.customers("acct_b") == set()
    got = await items_of(engine)
    assert got[("acct_a", "cus_gone")] == ("succeeded", None, 1)  # 404: deleted already
    assert {c.tenant for c in fake.calls} == {"acct_a", "acct_b"}
    assert all(c.idempotency_key for c in fake.calls)


async def stored_credentials(engine: AsyncEngine, secrets: dict[str, str], upstream: str
                             ) -> Credentials:
    """Credentials put through the API's store (the write path of the PUT route)."""
    keyring = Keyring([KEY])
    for tenant, secret in secrets.items():
        await tenant_credentials.put(engine, keyring, tenant, upstream, secret, actor="test")
    return Credentials({upstream: CredentialStore(engine, keyring)})


async def test_commercetools_conflicts_are_retried_with_the_current_version(
        engine: AsyncEngine) -> None:
    fake = FakeCommercetools()
    fake.add_project("proj-a", "tok-a")
    fake.add_customers("proj-a", ["c1", "c2"], version=4)
    fake.add_customers("proj-a", ["c3"], version=1)
    async with serve(fake) as port:
        policies = on_loopback("commercetools", f"http://127.0.0.1:{port}")
        credentials = await stored_credentials(engine, {"proj-a": "tok-a"}, "commercetools")
        await register(engine, policies, [("proj-a", "c1"), ("proj-a", "c2"), ("proj-a", "c3"),
                                          ("proj-a", "missing")])
        await drain(engine, policies, credentials, settled(4))
    assert fake.customers("proj-a") == {}
    got = await items_of(engine)
    # a stale version costs one call, retried at once with the version the 409 named
    assert got[("proj-a", "c1")] == ("succeeded", None, 2)
    assert got[("proj-a", "c3")] == ("succeeded", None, 1)
    assert got[("proj-a", "missing")] == ("succeeded", None, 1)
    versions = sorted((c.path.rsplit("/", 1)[1], c.query) for c in fake.calls)
    assert versions == [("c1", "version=1"), ("c1", "version=4"), ("c2", "version=1"),
                        ("c2", "version=4"), ("c3", "version=1"), ("missing", "version=1")]


async def test_bigcommerce_store_tokens_and_its_quota(engine: AsyncEngine) -> None:
    fake = FakeBigCommerce(quota=5, window_s=1.0)
    fake.add_store("abc123", "tok-abc")
    fake.add_store("def456", "tok-def")
    fake.add_customers("abc123", range(1, 9))
    fake.add_customers("def456", [9])
    async with serve(fake) as port:
        policies = on_loopback("bigcommerce", f"http://127.0.0.1:{port}/stores")
        credentials = await stored_credentials(engine, {"abc123": "tok-abc", "def456": "wrong"},
                                   "bigcommerce")
        await register(engine, policies, [("abc123", str(i)) for i in range(1, 9)]
                       + [("def456", "9")])
        await drain(engine, policies, credentials, settled(8))
    assert fake.customers("abc123") == set()
    # a refused token pauses that store's scope alone, as `unauthorized`, for an operator
    assert await scope_pause(engine, "bigcommerce-customers:def456") == (True, "unauthorized")
    assert fake.customers("def456") == {9}
    assert (await items_of(engine))[("def456", "9")][0] == "pending"


async def test_bigcommerce_deletes_250_customers_a_call(engine: AsyncEngine) -> None:
    """600 of a store's customers in 3 calls (250, 250, 100), the ids in the query; every
    item has its own attempt and outcome; each call's key is its batch's identity."""
    fake = FakeBigCommerce(quota=150, window_s=30.0)
    fake.add_store("abc123", "tok-abc")
    fake.add_customers("abc123", range(1, 601))
    async with serve(fake) as port:
        policies = on_loopback("bigcommerce", f"http://127.0.0.1:{port}/stores")
        credentials = await stored_credentials(engine, {"abc123": "tok-abc"}, "bigcommerce")
        await register(engine, policies, [("abc123", str(i)) for i in range(1, 601)])
        await drain(engine, policies, credentials, settled(600))
    assert fake.customers("abc123") == set()
    assert await statuses(engine) == {"succeeded": 600}
    assert sorted(len(d.requested) for d in fake.deletions) == [100, 250, 250]
    keys = [c.idempotency_key for c in fake.calls]
    assert len(set(keys)) == 3 and all(keys)
    async with engine.connect() as conn:
        attempts = (await conn.execute(text(
            "SELECT (SELECT count(*) FROM attempts), count(*) FROM items "
            "WHERE status = 'succeeded' AND attempts = 1"))).one()
    assert tuple(attempts) == (0, 600)  # each success on its item, after one attempt


async def test_a_scope_waiting_for_nothing_any_more_resumes(engine: AsyncEngine,
                                                            tmp_path: Path) -> None:
    """Paused `no-credential` under one policies file, the scope resumes under a file whose
    upstream no longer takes per-tenant credentials, and an operator's pause that happens
    to say `no-credential` is never lifted by it."""
    policies = on_loopback("stripe", "http://127.0.0.1:9")
    await register(engine, policies, [("acct_a", "cus_1"), ("acct_b", "cus_2")])
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE scopes SET paused = true, "
                                "paused_reason = 'no-credential'"))
    stored = await stored_credentials(engine, {}, "stripe")
    # the PUT path looks at its tenant only; nobody has a credential yet
    assert await resume_arrived(engine, policies, stored, tenant_id="acct_a") == []
    assert await scope_pause(engine, "stripe:acct_b") == (True, "no-credential")
    await tenant_credentials.put(engine, Keyring([KEY]), "acct_b", "stripe", "sk_b",
                                 actor="test")
    assert await resume_arrived(engine, policies, stored, tenant_id="acct_a") == []
    assert await resume_arrived(engine, policies, stored) == ["stripe:acct_b"]
    # the policies file changed: the upstream takes no per-tenant credential any more
    doc = vendor_block("stripe")
    doc["upstreams"]["stripe"] = {"base_url": "http://127.0.0.1:9"}
    doc["policies"]["stripe-customers"]["scope"] = "stripe:{tenant_id}"
    assert await resume_arrived(engine, policies_from(doc), Credentials({})) == [
        "stripe:acct_a"]
    # an operator's pause keeps its reason apart from the answers' own
    assert await scope_controls.pause(engine, "stripe:acct_a", actor="op", reason="no-credential")
    assert await scope_pause(engine, "stripe:acct_a") == (True, "operator: no-credential")
    assert await resume_arrived(engine, policies_from(doc), Credentials({})) == []

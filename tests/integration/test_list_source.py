"""An upstream's list as a policy's source, end to end against a real paginated list endpoint
on loopback (tests/fakes/upstream.py `ListEndpoint`) and a real PostgreSQL: report-only first
with per-tenant figures, then the real run registering and deleting through the policy's HTTP
target; a crash resuming from the persisted cursor; malformed entries recorded and skipped;
401 pausing the tenant's scope, 429 closing it, an unreachable endpoint losing nothing
(docs/stores.md, "Listing an upstream")."""

from __future__ import annotations

import asyncio
import json
import tomllib
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from drills.vendors import example_block
from service.budget import buckets
from service.budget import scope_controls as scopes
from service.budget.credential_waits import Credentials
from service.config.policies import Policies
from service.runs import discovery, publication, trigger
from service.runs.discovery import Discovery
from service.sweeps.store_databases import Stores
from tests.conftest import REPO_ROOT, LiveServer, free_port, policies_from, test_settings
from tests.fakes.upstream import Call, FakeUpstream, Fault, ListEndpoint
from tests.integration.db_clock import advance
from tests.integration.test_cli import assert_one_clean_line, sweeper
from tests.integration.test_stores import wait_run

NOW = datetime.now(UTC)
OLD = NOW - timedelta(days=40)
RECENT = NOW - timedelta(days=2)
LIST_PATH = "/customers?updated_before={cutoff}&limit={page}&cursor={cursor}"


def rest_policies(base_url: str, tenants: list[str], **source: Any) -> Policies:
    """A REST list source (`?updated_before=&cursor=`) whose items are deleted one call
    each, at the test suite's scale."""
    return policies_from({
        "upstreams": {"shop": {"base_url": base_url + "/shops/{tenant_id}",
                               "timeout_seconds": 2}},
        "policies": {"stale-customers": {
            "version": 1, "upstream": "shop", "method": "DELETE",
            "path": "/customers/{object_id}", "scope": "shop:{tenant_id}",
            "rate": {"per_second": 500, "burst": 50}, "lease_seconds": 30,
            "max_attempts": 3, "absent_means_deleted": True,
            "backoff": {"base_seconds": 0.05, "max_seconds": 0.2},
            "source": {"upstream": "shop", "path": LIST_PATH, "tenants": tenants,
                       "items": "items[*]", "id": "id", "age": "updated_at",
                       "next": "next_cursor", "page": 10, "older_than": "P30D", **source}}}})


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeUpstream, ListEndpoint]]:
    endpoint = ListEndpoint(tenant_segment=2)
    async with FakeUpstream() as up:
        up.route("/shops/", endpoint)
        yield up, endpoint


def list_calls(up: FakeUpstream) -> list[Call]:
    return [c for c in up.calls() if c.method == "GET"]


def cursor_of(call: Call) -> str | None:
    return parse_qs(call.query).get("cursor", [None])[0]


def api(live: LiveServer) -> httpx.AsyncClient:
    """A client of `live`, whose runs' progress it polls until they drain."""
    live.count_progress_afresh()
    return live.client()


async def test_report_only_then_the_real_run_deletes_through_the_http_target(
        db_url: str, fake: tuple[FakeUpstream, ListEndpoint]) -> None:
    up, endpoint = fake
    endpoint.add("shop-a", range(1, 26), OLD)
    endpoint.add("shop-b", range(100, 107), OLD)
    for shop in ("shop-a", "shop-b", "shop-c"):
        endpoint.add(shop, [f"{shop}-new-{n}" for n in range(3)], RECENT)  # not yet due
    policies = rest_policies(up.base_url, ["shop-c", "shop-b", "shop-a"])
    async with LiveServer(test_settings(db_url, workers=4), policies, db_url) as live, \
            api(live) as client:
        dry = (await client.post("/v1/runs", json={"policy": "stale-customers",
                                                   "dry_run": True})).json()
        dry = await wait_run(client, dry["id"], drained=False)
        assert (dry["candidates"], dry["released"]) == (32, 0)
        figures = dry["report"]["policies"]["stale-customers"]
        # shop-a: 3 pages of 10; shop-b and shop-c one each
        assert figures["source"] == {"pages": 5, "candidates": 32, "registered": 0,
                                     "errors": 0, "error_samples": []}
        assert endpoint.deleted == [] and len(endpoint.remaining("shop-a")) == 28
        # each tenant's walk: its first page without a cursor, then each page's next one
        calls = list_calls(up)
        assert [c.path for c in calls] == ["/shops/shop-a/customers"] * 3 + [
            "/shops/shop-b/customers", "/shops/shop-c/customers"]
        assert cursor_of(calls[0]) is None and cursor_of(calls[1]) is not None
        assert parse_qs(calls[0].query)["updated_before"] == [
            (datetime.fromisoformat(dry["cutoff"]) - timedelta(days=30)).strftime(
                "%Y-%m-%dT%H:%M:%SZ")]

        endpoint.add("shop-c", ["c1", "c2", "c3"], OLD)
        again = (await client.post("/v1/runs", json={"policy": "stale-customers",
                                                     "dry_run": True})).json()
        again = await wait_run(client, again["id"], drained=False)
        assert again["report"]["previous_dry_run"] == {
            "run_id": dry["id"], "candidates": 32, "difference": 3}
        found = (await client.get(f"/v1/runs/{again['id']}/discovery")).json()
        [walk] = found["policies"]
        assert walk["done"] and (walk["candidates"], walk["registered"]) == (35, 0)
        assert {t["tenant_id"]: (t["candidates"], t["previous_candidates"], t["difference"])
                for t in walk["tenants"]} == {"shop-a": (25, 25, 0), "shop-b": (7, 7, 0),
                                              "shop-c": (3, None, 3)}
        assert {t["tenant_id"]: t["oldest_age"][:10] for t in walk["tenants"]} == {
            t: OLD.date().isoformat() for t in ("shop-a", "shop-b", "shop-c")}
        assert endpoint.deleted == []

        real = (await client.post("/v1/runs", json={"policy": "stale-customers"})).json()
        real = await wait_run(client, real["id"], drained=True)
        assert real["candidates"] == 35 and real["items"] == {"succeeded": 35}
        assert sorted(endpoint.deleted) == sorted(
            [("shop-a", str(n)) for n in range(1, 26)]
            + [("shop-b", str(n)) for n in range(100, 107)]
            + [("shop-c", c) for c in ("c1", "c2", "c3")])
        for shop in ("shop-a", "shop-b", "shop-c"):  # what is not due stays
            assert endpoint.remaining(shop) == [f"{shop}-new-{n}" for n in range(3)]
        deletes = [c for c in up.calls() if c.method == "DELETE"]
        assert len(deletes) == 35 == len({c.idempotency_key for c in deletes})


def example(base_url: str, credentials: Path) -> Policies:
    """The `http-list` block of policies.example.toml as written (at the test suite's
    pace), its upstream's base URL pointed at the fake (the shop's domain in the path: one
    loopback host serves every shop) and its credentials at `credentials`."""
    doc = tomllib.loads(example_block(REPO_ROOT / "policies.example.toml", "http-list"))
    [policy] = doc["policies"].values()
    policy["rate"] = {"per_second": 500, "burst": 100}  # the test suite's pace
    [upstream] = doc["upstreams"].values()
    upstream.pop("host_pattern")
    upstream.update(base_url=base_url + "/{tenant_id}/admin/api/2025-10",
                    credentials={"directory": str(credentials)})
    return policies_from(doc)


async def test_the_example_walks_each_shop_and_a_refused_token_pauses_only_its_scope(
        db_url: str, engine: AsyncEngine, tmp_path: Path) -> None:
    shops = ("shop-a.myshopify.com", "shop-b.myshopify.com")
    endpoint = ListEndpoint(tenant_segment=1, tokens={shops[0]: "shpat_a", shops[1]: "shpat_b"})
    endpoint.add(shops[0], range(1, 131), NOW - timedelta(days=800))
    endpoint.add(shops[0], [900], NOW - timedelta(days=10))  # active: not two years old
    endpoint.add(shops[1], range(200, 205), NOW - timedelta(days=800))
    (tmp_path / shops[0]).write_text("shpat_a\n")
    (tmp_path / shops[1]).write_text("revoked")
    async with FakeUpstream() as up:
        up.route("/", endpoint)
        policies = example(up.base_url, tmp_path)
        async with LiveServer(test_settings(db_url, workers=4), policies, db_url) as live, \
                api(live) as client:
            run = (await client.post("/v1/runs", json={"policy": "inactive-customers"})).json()
            run = await wait_run(client, run["id"], drained=True)
            assert run["candidates"] == 130 and run["items"] == {"succeeded": 130}
            found = (await client.get(f"/v1/runs/{run['id']}/discovery")).json()
            [walk] = found["policies"]
            assert walk["done"] and (walk["pages"], walk["registered"]) == (2, 130)
            assert walk["errors"] == 1
            [problem] = walk["error_samples"]
            assert problem["tenant_id"] == repr(shops[1])
            assert problem["problem"].startswith("list call http_401: scope "
                                                 "'shopify:shop-b.myshopify.com' paused")
            scopes = {s["name"]: s for s in (await client.get("/v1/scopes")).json()["scopes"]}
            assert scopes["shopify:shop-b.myshopify.com"]["paused"]
            assert scopes["shopify:shop-b.myshopify.com"]["paused_reason"] == "unauthorized"
            assert not scopes["shopify:shop-a.myshopify.com"]["paused"]
    assert endpoint.remaining(shops[0]) == ["900"]
    assert endpoint.remaining(shops[1]) == [str(n) for n in range(200, 205)]  # untouched
    pages = [json.loads(c.body)["variables"] for c in up.calls()
             if "customers(" in c.body and c.outcome == "ok"]
    # the first page of each shop without a cursor, 100 a page, two years before the cutoff
    assert [(p["first"], p["cursor"] is None) for p in pages] == [(100, True), (100, False),
                                                                  (100, True)]
    cutoff = datetime.fromisoformat(run["cutoff"]) - timedelta(days=730)
    assert pages[0]["query"] == f"updated_at:<'{cutoff.strftime('%Y-%m-%dT%H:%M:%SZ')}'"


def nth(n: int, path: str = "/customers") -> Callable[[Call], bool]:
    """A fault's match: the n-th list call (from 1), counted by the fake under its lock."""
    seen = [0]

    def match(call: Call) -> bool:
        if call.method != "GET" or not call.path.endswith(path):
            return False
        seen[0] += 1
        return seen[0] == n

    return match


async def walk_of(engine: AsyncEngine, run_id: int) -> dict[str, Any]:
    report = await discovery.report(engine, run_id)
    assert report is not None
    [walk] = report["policies"]
    return dict(walk)


async def run_state(engine: AsyncEngine, run_id: int) -> tuple[str, int]:
    async with engine.connect() as conn:
        row = (await conn.execute(text("SELECT state, released FROM runs WHERE id = :id"),
                                  {"id": run_id})).one()
    return row[0], row[1]


async def new_run(engine: AsyncEngine, *, dry_run: bool = False) -> int:
    run_id, _ = await trigger.create_run(engine, trigger.RunRequest(
        "stale-customers", None, None, dry_run, None), None)
    return run_id


def publisher(policies: Policies) -> Discovery:
    """Discovery as the app's publisher builds it."""
    return Discovery(policies, Stores(policies.stores), Credentials({}))


async def test_a_crash_resumes_from_the_persisted_cursor_and_malformed_entries_are_skipped(
        engine: AsyncEngine, fake: tuple[FakeUpstream, ListEndpoint]) -> None:
    up, endpoint = fake
    endpoint.add("shop-a", [f"a{n:03}" for n in range(45)], OLD)
    endpoint.add("shop-b", [f"b{n:03}" for n in range(12)], OLD)
    # entries no item can be made of, on shop-a's last pages (listed after the others)
    later = (OLD + timedelta(minutes=1)).isoformat()
    for key, entry in (("z1", {"id": None, "updated_at": later}),
                       ("z2", {"id": {"nested": 1}, "updated_at": later}),
                       ("z3", {"id": "bad\x01id", "updated_at": later}),
                       ("z4", {"id": "z4", "updated_at": "last tuesday"}),
                       ("z5", {"id": "z5"}),
                       ("z6", {"id": True, "updated_at": later})):
        endpoint.add_raw("shop-a", key, entry)
    policies = rest_policies(up.base_url, ["shop-a", "shop-b"])
    run_id = await new_run(engine)
    # the third list call never answers; the process dies while it waits
    up.inject(Fault.HANG, times=1, match=nth(3), seconds=30)
    task = asyncio.create_task(publication.publish_pending(engine, batch_size=50,
                                                           discovery=publisher(policies)))
    async with asyncio.timeout(10):
        while len(list_calls(up)) < 3:
            await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    walk = await walk_of(engine, run_id)
    assert (walk["pages"], walk["candidates"], walk["registered"]) == (2, 20, 20)
    assert not walk["done"]
    assert await run_state(engine, run_id) == ("publishing", 0)

    # another replica's publisher picks the run up where the cursor stands
    assert await publication.publish_pending(engine, batch_size=50,
                                             discovery=publisher(policies)) == 1
    calls = list_calls(up)
    assert cursor_of(calls[3]) == cursor_of(calls[2])  # the hung page, asked again
    assert cursor_of(calls[2]) is not None
    walk = await walk_of(engine, run_id)
    assert walk["done"] and walk["failure"] is None
    assert (walk["candidates"], walk["registered"], walk["errors"]) == (57, 57, 6)
    assert sorted(s["problem"] for s in walk["error_samples"]) == [
        "age is missing", "age is not an ISO 8601 time with an offset, nor Unix seconds",
        "object_id is missing", "object_id is not a string or an integer",
        "object_id is not a string or an integer",
        "object_id must not contain control characters or unpaired surrogates"]
    async with engine.connect() as conn:
        counts = (await conn.execute(text(
            "SELECT count(*), count(DISTINCT (tenant_id, object_id)), count(batch_id) "
            "FROM items"))).one()
    assert tuple(counts) == (57, 57, 57)  # each registered once, all released
    assert await run_state(engine, run_id) == ("published", 57)


async def scope_row(engine: AsyncEngine, scope: str) -> Any:
    async with engine.connect() as conn:
        return (await conn.execute(text(
            "SELECT paused, paused_reason, closed_until > clock_timestamp() AS closed, "
            "closed_reason FROM scopes WHERE name = :n"), {"n": scope})).one()


async def test_a_429_closes_the_scope_and_discovery_waits_for_it(
        engine: AsyncEngine, fake: tuple[FakeUpstream, ListEndpoint]) -> None:
    up, endpoint = fake
    endpoint.add("shop-a", range(25), OLD)
    up.inject(Fault.STATUS, times=1, match=nth(2), status=429,
              headers={"Retry-After": "30"})
    policies = rest_policies(up.base_url, ["shop-a"])
    run_id = await new_run(engine, dry_run=True)
    assert await publication.publish_pending(engine, batch_size=50,
                                             discovery=publisher(policies)) == 0
    scope = await scope_row(engine, "shop:shop-a")
    assert scope.closed and scope.closed_reason == "http_429" and not scope.paused
    walk = await walk_of(engine, run_id)
    assert walk["pages"] == 1 and not walk["done"]
    assert "http_429" in walk["failure"] and "closed" in walk["failure"]
    # while the scope is closed, the next passes wait without calling
    assert await publication.publish_pending(engine, batch_size=50,
                                             discovery=publisher(policies)) == 0
    assert len(list_calls(up)) == 2
    assert "closed until" in (await walk_of(engine, run_id))["failure"]
    await advance(engine, 31)  # Retry-After has passed
    assert await publication.publish_pending(engine, batch_size=50,
                                             discovery=publisher(policies)) == 1
    walk = await walk_of(engine, run_id)
    assert walk["done"] and (walk["pages"], walk["candidates"]) == (3, 25)
    assert len(list_calls(up)) == 4  # the throttled page asked again from its cursor
    assert cursor_of(list_calls(up)[2]) == cursor_of(list_calls(up)[1])


async def test_an_unreachable_or_failing_endpoint_loses_nothing(engine: AsyncEngine) -> None:
    port = free_port()  # nothing listens there yet
    policies = rest_policies(f"http://127.0.0.1:{port}", ["shop-a"])
    run_id = await new_run(engine)
    assert await publication.publish_pending(engine, batch_size=50,
                                             discovery=publisher(policies)) == 0
    walk = await walk_of(engine, run_id)
    assert "connect_error" in walk["failure"] and walk["pages"] == 0
    assert await run_state(engine, run_id) == ("publishing", 0)
    assert not (await scope_row(engine, "shop:shop-a")).paused  # an outage pauses nothing

    endpoint = ListEndpoint(tenant_segment=2)
    endpoint.add("shop-a", range(15), OLD)
    async with FakeUpstream(port=port) as up:
        up.route("/shops/", endpoint)
        up.inject(Fault.STATUS, times=1, match=nth(2), status=503)
        assert await publication.publish_pending(engine, batch_size=50,
                                                 discovery=publisher(policies)) == 0
        walk = await walk_of(engine, run_id)
        assert "http_503" in walk["failure"] and walk["pages"] == 1
        assert await publication.publish_pending(engine, batch_size=50,
                                                 discovery=publisher(policies)) == 1
    walk = await walk_of(engine, run_id)
    assert walk["done"] and (walk["candidates"], walk["registered"]) == (15, 15)
    assert await run_state(engine, run_id) == ("published", 15)


async def test_a_pass_reads_at_most_its_pages_and_the_next_pass_goes_on(
        engine: AsyncEngine, fake: tuple[FakeUpstream, ListEndpoint]) -> None:
    up, endpoint = fake
    endpoint.add("shop-a", range(35), OLD)
    policies = rest_policies(up.base_url, ["shop-a"], pages_per_pass=2)
    run_id = await new_run(engine)
    assert await publication.publish_pending(engine, batch_size=50,
                                             discovery=publisher(policies)) == 0
    walk = await walk_of(engine, run_id)
    assert (walk["pages"], walk["candidates"], walk["done"]) == (2, 20, False)
    assert await publication.publish_pending(engine, batch_size=50,
                                             discovery=publisher(policies)) == 1
    walk = await walk_of(engine, run_id)
    assert (walk["pages"], walk["candidates"], walk["done"]) == (4, 35, True)


async def test_a_cursor_that_repeats_ends_the_tenants_walk_as_an_error(
        engine: AsyncEngine, fake: tuple[FakeUpstream, ListEndpoint]) -> None:
    up, endpoint = fake
    endpoint.add("shop-a", range(5), OLD)
    endpoint.add("shop-b", range(3), OLD)
    page = {"items": [{"id": "x1", "updated_at": OLD.isoformat()}], "next_cursor": "same"}
    up.inject(Fault.STATUS, times=2, match=lambda c: c.path == "/shops/shop-a/customers",
              status=200, headers={"Content-Type": "application/json"},
              body=json.dumps(page).encode())
    policies = rest_policies(up.base_url, ["shop-a", "shop-b"])
    run_id = await new_run(engine, dry_run=True)
    assert await publication.publish_pending(engine, batch_size=50,
                                             discovery=publisher(policies)) == 1
    walk = await walk_of(engine, run_id)
    assert walk["done"] and walk["candidates"] == 1 + 1 + 3
    [problem] = walk["error_samples"]
    assert problem["problem"] == ("the next cursor repeats this page's: this tenant's walk "
                                  "ends here")
    assert [t["tenant_id"] for t in walk["tenants"]] == ["shop-b", "shop-a"]


def example_file(tmp_path: Path, replace: tuple[str, str] | None = None) -> Path:
    """The `http-list` block of the example, uncommented into a file of its own (its
    credentials in a directory that exists)."""
    text_ = example_block(REPO_ROOT / "policies.example.toml", "http-list").replace(
        "/var/run/secrets/shopify", str(tmp_path))
    if replace is not None:
        assert replace[0] in text_
        text_ = text_.replace(*replace)
    path = tmp_path / "policies.toml"
    path.write_text(text_)
    return path


@pytest.mark.slow
def test_check_config_shows_the_list_request(tmp_path: Path) -> None:
    result = sweeper("check-config", env={"SWEEPER_POLICIES_FILE": str(example_file(tmp_path))})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    at = lines.index("policies.inactive-customers.source on upstream 'shopify-admin' (2 "
                     "tenant(s); the first page of 'shop-a.myshopify.com'):")
    assert lines[at + 1] == ("  POST https://shop-a.myshopify.com/admin/api/2025-10/"
                             "graphql.json")
    body = json.loads(lines[at + 2])
    assert body["variables"]["first"] == 100 and body["variables"]["cursor"] is None
    assert body["variables"]["query"].startswith("updated_at:<'")


@pytest.mark.slow
def test_a_bad_list_source_key_exits_2_naming_it(tmp_path: Path) -> None:
    path = example_file(tmp_path, ("pages_per_pass = 100", "pages_per_pass = 100000"))
    result = sweeper("check-config", env={"SWEEPER_POLICIES_FILE": str(path)})
    assert_one_clean_line(result, 2, str(path),
                          "policies.inactive-customers.source.pages_per_pass")


async def test_a_paused_scope_skips_its_tenant_and_paused_workers_hold_discovery(
        engine: AsyncEngine, fake: tuple[FakeUpstream, ListEndpoint]) -> None:
    up, endpoint = fake
    endpoint.add("shop-a", range(4), OLD)
    endpoint.add("shop-b", range(6), OLD)
    policies = rest_policies(up.base_url, ["shop-a", "shop-b"])
    async with engine.begin() as conn:
        await buckets.ensure_scopes(conn, {"shop:shop-a": (500.0, 50, 1)})
    assert await scopes.pause(engine, "shop:shop-a", actor="test", reason="rehearsal")
    await scopes.set_workers_paused(engine, paused=True, actor="test", reason="deploy")
    run_id = await new_run(engine)
    # every scope grants nothing while the workers are paused: discovery waits, no call
    assert await publication.publish_pending(engine, batch_size=50,
                                             discovery=publisher(policies)) == 0
    assert list_calls(up) == []
    assert "the workers are paused" in (await walk_of(engine, run_id))["failure"]
    await scopes.set_workers_paused(engine, paused=False, actor="test", reason=None)
    assert await publication.publish_pending(engine, batch_size=50,
                                             discovery=publisher(policies)) == 1
    walk = await walk_of(engine, run_id)
    assert walk["done"] and (walk["pages"], walk["candidates"], walk["errors"]) == (1, 6, 1)
    [problem] = walk["error_samples"]
    assert problem == {"tenant_id": "'shop-a'", "object_id": "", "problem": (
        "scope 'shop:shop-a' is paused (rehearsal); this tenant is not walked in this run")}
    assert [c.path for c in list_calls(up)] == ["/shops/shop-b/customers"]
    assert await run_state(engine, run_id) == ("published", 6)


async def test_a_graphql_throttle_inside_a_200_closes_the_shops_scope(
        engine: AsyncEngine, tmp_path: Path) -> None:
    shop = "shop-a.myshopify.com"
    endpoint = ListEndpoint(tenant_segment=1, tokens={shop: "shpat_a"})
    endpoint.add(shop, range(1, 6), NOW - timedelta(days=800))
    (tmp_path / shop).write_text("shpat_a")
    throttled = {"errors": [{"message": "Throttled", "extensions": {"code": "THROTTLED"}}]}
    async with FakeUpstream() as up:
        up.route("/", endpoint)
        up.inject(Fault.STATUS, times=1, status=200, body=json.dumps(throttled).encode(),
                  headers={"Content-Type": "application/json"})
        policies = example(up.base_url, tmp_path)
        credentials = Credentials.of(policies, engine, None)
        run_id, _ = await trigger.create_run(engine, trigger.RunRequest(
            "inactive-customers", shop, None, True, None), None)
        assert await publication.publish_pending(engine, batch_size=50, discovery=Discovery(
            policies, Stores({}), credentials)) == 0
        scope = await scope_row(engine, f"shopify:{shop}")
        assert scope.closed and scope.closed_reason == "http_200:throttled"
        assert "http_200:throttled" in (await walk_of(engine, run_id))["failure"]
        await advance(engine, 5)  # the policy's backoff (no Retry-After) has passed
        assert await publication.publish_pending(engine, batch_size=50, discovery=Discovery(
            policies, Stores({}), credentials)) == 1
    walk = await walk_of(engine, run_id)
    assert walk["done"] and (walk["candidates"], walk["errors"]) == (5, 0)

"""What a hostile or careless caller sends, over HTTP to a live server on a real database:
every answer is a clear 4xx problem, nothing already accepted is lost, and nothing is
widened, stalled or echoed. (The process-level limits, on a real `sweeper serve`, are in
test_hostile_process.py.)"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from fastapi.routing import APIRoute
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from service.commands.openapi import openapi_document
from service.config.settings import async_url
from service.db.engine import make_engine
from service.http.api.bodies import JsonRoute
from tests.conftest import LiveServer, eventually, test_settings
from tests.integration.test_webhooks import SHOP, make_policies, post, shopify

ITEM = {"tenant_id": SHOP, "object_id": "cart-1", "policy": "carts",
        "due_at": "2026-01-01T00:00:00Z"}


@pytest.fixture
async def live(db_url: str) -> AsyncIterator[LiveServer]:
    async with LiveServer(test_settings(db_url, body_read_timeout_seconds=1.0),
                          make_policies(), db_url) as server:
        yield server


@pytest.fixture
async def client(live: LiveServer) -> AsyncIterator[httpx.AsyncClient]:
    async with live.client() as c:
        yield c


def issues(response: httpx.Response) -> list[tuple[str, str]]:
    """(location, type) of each validation issue of a 422."""
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    return [(".".join(e["loc"]), e["type"]) for e in response.json()["errors"]]


async def count(engine: AsyncEngine, sql: str) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text(sql))).scalar_one())


# --- 1. timestamps ------------------------------------------------------------------------

@pytest.mark.parametrize("due_at", [
    "0001-01-01T00:00:00+14:00",      # year 0 in UTC: stored BC, stopped every run
    "9999-12-31T23:59:59-12:00",      # year 10000 in UTC
    "1969-12-31T23:59:59Z",           # below the documented range
    "9999-12-31T00:00:00.000001Z",    # just above it
    "1700000000",                     # digits are not read as epoch seconds
    "2026-01-01",                     # a date is not a date-time
    "2026-01-01T00:00:00",            # no offset
    "2026-01-01T00:00:00+24:00",      # not an offset
    "٢٠٢٦-01-01T00:00:00Z",           # non-ASCII digits
])
async def test_registration_refuses_timestamps_out_of_range(
        client: httpx.AsyncClient, engine: AsyncEngine, due_at: str) -> None:
    answer = await client.post("/v1/items", json={"items": [{**ITEM, "due_at": due_at}]})
    [(where, _rule)] = issues(answer)
    assert where == "body.items.0.due_at"
    assert due_at not in answer.text
    assert await count(engine, "SELECT count(*) FROM items") == 0


async def test_the_range_ends_are_accepted_listed_and_published(
        client: httpx.AsyncClient) -> None:
    low, high = "1970-01-01T00:00:00Z", "9999-12-30T10:00:00-13:59"
    # RFC 3339 offsets reach 23:59; PostgreSQL's stop at 15:59
    far = "2971-05-04T22:25:51.6-22:57"
    answer = await client.post("/v1/items", json={"items": [
        {**ITEM, "object_id": "low", "due_at": low},
        {**ITEM, "object_id": "high", "due_at": high},
        {**ITEM, "object_id": "far", "due_at": far}]})
    assert answer.status_code == 200, answer.text
    listed = await client.get("/v1/items")
    assert listed.status_code == 200
    assert [i["due_at"] for i in listed.json()["items"]] == [
        "1970-01-01T00:00:00Z", "9999-12-30T23:59:00Z", "2971-05-05T21:22:51.600000Z"]
    run = await client.post("/v1/runs", json={"cutoff": "9999-12-31T00:00:00Z"})
    assert run.status_code == 202, run.text
    async def published() -> dict[str, Any] | None:
        status: dict[str, Any] = (await client.get(f"/v1/runs/{run.json()['id']}")).json()
        return status if status["state"] != "publishing" else None

    status = await eventually(published, "the run published")
    assert status["state"] == "published" and status["released"] == 3
    far_cutoff = await client.post("/v1/runs", json={"cutoff": far, "dry_run": True})
    assert far_cutoff.status_code == 202, far_cutoff.text
    assert far_cutoff.json()["cutoff"] == "2971-05-05T21:22:51.600000Z"


@pytest.mark.parametrize("cutoff", ["0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-12:00",
                                    "1700000000", 1700000000])
async def test_a_run_refuses_a_cutoff_out_of_range(client: httpx.AsyncClient,
                                                   cutoff: Any) -> None:
    assert issues(await client.post("/v1/runs", json={"cutoff": cutoff})) == [
        ("body.cutoff", "value_error")]


# --- 5. unknown fields --------------------------------------------------------------------

@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/runs", {"dryrun": True}, "dryrun"),
    ("/v1/runs", {"dryRun": True}, "dryRun"),
    ("/v1/items/cancel", {"policy": "carts", "tenantid": SHOP, "why": "offboard"},
     "tenantid"),
    ("/v1/items/redrive", {"policy": "carts", "why": "x", "limt": 1}, "limt"),
    ("/v1/items", {"items": [{**ITEM, "due": "2026-01-01T00:00:00Z"}]}, "items.0.due"),
    ("/v1/items", {"items": [ITEM], "dry_run": True}, "dry_run"),
    ("/v1/workers/pause", {"reason": "x", "why": "y"}, "why"),
])
async def test_unknown_fields_are_refused_by_name(client: httpx.AsyncClient,
                                                  engine: AsyncEngine, path: str,
                                                  body: dict[str, Any], field: str) -> None:
    await client.post("/v1/items", json={"items": [{**ITEM, "object_id": "keep"}]})
    assert issues(await client.post(path, json=body)) == [(f"body.{field}", "extra_forbidden")]
    # nothing was started, cancelled or paused
    assert await count(engine, "SELECT count(*) FROM runs") == 0
    assert await count(engine, "SELECT count(*) FROM items WHERE status = 'pending'") == 1
    assert (await client.get("/v1/workers")).json()["workers_paused"] is False


@pytest.mark.parametrize(("method", "query", "expected"), [
    ("GET", "limt=10", [("query.limt", "unknown_parameter")]),
    ("GET", "limit=1&limit=500", [("query.limit", "repeated_parameter")]),
    ("GET", "tenant_id=a&status=dead&tenant_id=b",
     [("query.tenant_id", "repeated_parameter")]),
    ("GET", "pollicy=x&pollicy=y&limit=1&limit=1",
     [("query.pollicy", "unknown_parameter"), ("query.limit", "repeated_parameter")]),
    ("POST", "dry_run=true", [("query.dry_run", "unknown_parameter")]),
])
async def test_query_parameters_are_declared_and_given_once(
        client: httpx.AsyncClient, engine: AsyncEngine, method: str, query: str,
        expected: list[tuple[str, str]]) -> None:
    """No operation takes a list in its query: a name given twice is refused, not read as
    one of its values, and an undeclared one is refused by name."""
    path = "/v1/items" if method == "GET" else "/v1/runs"
    body = None if method == "GET" else b'{"dry_run": true}'
    assert issues(await client.request(method, f"{path}?{query}", content=body)) == expected
    assert await count(engine, "SELECT count(*) FROM runs") == 0


def test_every_request_body_schema_forbids_additional_properties() -> None:
    schemas = openapi_document()["components"]["schemas"]  # type: ignore[index]
    bodies = ["RunIn", "ItemsIn", "ItemIn", "ItemSelection", "ItemRef", "BudgetIn", "ReasonIn"]
    for name in bodies:
        assert schemas[name].get("additionalProperties") is False, name


# --- 7 and 11. scopes -----------------------------------------------------------------------

@pytest.mark.parametrize("tenant", ["shop/eu", "a%2Fb", "50% off/é", "x/pause"])
async def test_every_scope_name_is_addressable(client: httpx.AsyncClient, tenant: str) -> None:
    """A scope is one percent-encoded path segment: '/' as %2F, '%' as %25, whatever the
    tenant id holds, even a name ending in '/pause'."""
    await client.post("/v1/items", json={"items": [{**ITEM, "tenant_id": tenant}]})
    name = f"tenant:{tenant}"
    path = quote(name, safe=":")
    paused = await client.post(f"/v1/scopes/{path}/pause", json={"reason": "test"})
    assert paused.status_code == 200, paused.text
    assert paused.json()["name"] == name and paused.json()["paused"] is True
    budget = await client.put(f"/v1/scopes/{path}", json={"rate_per_second": 2, "burst": 3})
    assert budget.status_code == 200 and budget.json()["burst"] == 3
    resumed = await client.post(f"/v1/scopes/{path}/resume")
    assert resumed.status_code == 200 and resumed.json()["paused"] is False


async def test_a_raw_slash_separates_segments(client: httpx.AsyncClient) -> None:
    await client.post("/v1/items", json={"items": [{**ITEM, "tenant_id": "shop/eu"}]})
    assert (await client.post("/v1/scopes/tenant:shop/eu/pause")).status_code == 404
    wrong = await client.put("/v1/scopes/tenant:x/pause", json={"rate_per_second": 1,
                                                               "burst": 1})
    assert wrong.status_code == 405 and wrong.headers["allow"] == "OPTIONS, POST"


async def test_an_unknown_scope_is_not_echoed(client: httpx.AsyncClient) -> None:
    answer = await client.post("/v1/scopes/tenant:secret-shop.example/pause")
    assert answer.status_code == 404
    assert "secret-shop" not in answer.text
    assert answer.json()["instance"] == f"urn:sweeper:request:{answer.headers['x-request-id']}"


# --- 8. database errors hide their parameters ----------------------------------------------

async def test_database_errors_carry_no_request_values(db_url: str) -> None:
    """The production engine hides statement parameters from its errors (and so from any
    log line or traceback that renders one)."""
    engine = make_engine(async_url(db_url), test_settings(db_url))
    try:
        async with engine.connect() as conn:
            with pytest.raises(DBAPIError) as raised:
                await conn.execute(text("SELECT length(CAST(:v AS text)) / 0"),
                                   {"v": "customer@example.com"})
    finally:
        await engine.dispose()
    assert "division by zero" in str(raised.value)
    assert "customer@example.com" not in str(raised.value)
    assert "parameters hidden" in str(raised.value)


# --- 9. an unstorable id in a webhook ------------------------------------------------------

async def test_a_webhook_id_with_an_unpaired_surrogate_is_a_clean_422(
        live: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    raw = b'{"id": "cart-\\ud800"}'
    async with live.client(None) as hooks:
        with caplog.at_level(logging.INFO):
            answer = await post(hooks, "shopify", shopify("orders/cancelled", None, raw=raw))
            assert answer.status_code == 422, answer.text
            assert answer.json()["type"] == "urn:sweeper:problem:unmappable-webhook"
            # the connection survived: the next delivery reuses it
            again = await post(hooks, "shopify", shopify("orders/cancelled", {"id": 5}))
            assert again.status_code == 202
    statuses = [getattr(r, "http.response.status_code", None) for r in caplog.records
                if r.getMessage() == "request"]
    assert statuses == [422, 202]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# --- 10. bodies that are not UTF-8 JSON ----------------------------------------------------

@pytest.mark.parametrize("body", [b'{"items": [{"tenant_id": "\xff"}]}', b"\xfe\xff\x00{"])
async def test_invalid_utf8_is_malformed_json(client: httpx.AsyncClient, body: bytes) -> None:
    answer = await client.post("/v1/items", content=body,
                               headers={"content-type": "application/json"})
    assert answer.status_code == 400
    assert answer.json()["type"] == "urn:sweeper:problem:malformed-json"


@pytest.mark.parametrize(("path", "body", "why"), [
    ("/v1/runs", b'{"dry_run": true, "dry_run": false}',
     "the key 'dry_run' appears twice in one object"),
    ("/v1/items", b'{"items": [{"tenant_id": "a", "object_id": "b", "policy": "carts", '
                  b'"due_at": "2026-01-01T00:00:00Z", "object_id": "c"}]}',
     "the key 'object_id' appears twice in one object"),
    ("/v1/runs", b'{"dry_run": true, "max_items": NaN}', "NaN is not JSON"),
    ("/v1/runs", b'{"dry_run": true, "max_items": -Infinity}', "-Infinity is not JSON"),
    ("/v1/items", b'{"items": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ("/v1/runs", b'{"dry_run": true, "max_items": ' + b"9" * 5000 + b"}",
     "a number has too many digits"),
], ids=["a-flag-twice", "an-id-twice", "nan", "infinity", "deep", "digits"])
async def test_json_is_read_strictly(client: httpx.AsyncClient, engine: AsyncEngine,
                                     path: str, body: bytes, why: str) -> None:
    """What Python's reader takes and JSON does not say one way is refused, not guessed at:
    the last of two `dry_run`s would have started a real deletion."""
    answer = await client.post(path, content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["type"] == "urn:sweeper:problem:malformed-json"
    assert answer.json()["detail"] == f"the body could not be parsed as JSON: {why}"
    assert await count(engine, "SELECT count(*) FROM runs") == 0
    assert await count(engine, "SELECT count(*) FROM items") == 0


async def test_every_operator_route_reads_its_body_strictly(live: LiveServer) -> None:
    """A router added without JsonRoute would read `{"dry_run": true, "dry_run": false}` as
    a real run: every operation that takes a body is a JsonRoute."""
    with_bodies = [r for r in live.app.state.route_methods.routes if isinstance(r, APIRoute)
                   and r.body_field is not None and r.path.startswith("/v1/")]
    assert len(with_bodies) >= 10
    assert [r.path for r in with_bodies if not isinstance(r, JsonRoute)] == []


# --- 12. a run's tenant id ------------------------------------------------------------------

@pytest.mark.parametrize(("tenant", "rule"), [
    ("a\x00b", "string_pattern_mismatch"), ("t\x1b[31m", "string_pattern_mismatch"),
    ("x" * 5_000_000, "string_too_long"), ("", "string_too_short"),
    ("é" * 300, "invalid_id"),  # 300 characters, 600 bytes
])
async def test_a_run_validates_its_tenant_like_a_registered_id(
        client: httpx.AsyncClient, engine: AsyncEngine, tenant: str, rule: str) -> None:
    assert issues(await client.post("/v1/runs", json={"tenant_id": tenant})) == [
        ("body.tenant_id", rule)]
    assert await count(engine, "SELECT count(*) FROM runs") == 0


# --- 13. the unauthenticated, and methods --------------------------------------------------

@pytest.mark.parametrize(("method", "path", "content"), [
    ("POST", "/v1/items", b"{not json"), ("POST", "/v1/runs", b'{"max_items": 0}'),
    ("GET", "/v1/items?status=gone", None), ("HEAD", "/v1/items", None),
    ("OPTIONS", "/v1/runs", None), ("DELETE", "/v1/items", None), ("GET", "/v1/nothing", None),
])
async def test_the_unauthenticated_get_401_before_anything_else(
        live: LiveServer, method: str, path: str, content: bytes | None) -> None:
    async with live.client(None) as anonymous:
        answer = await anonymous.request(method, path, content=content,
                                         headers={"content-type": "application/json"})
    assert answer.status_code == 401
    assert answer.headers["www-authenticate"] == 'Bearer realm="sweeper"'


async def test_an_unread_body_is_refused_before_it_is_sent(live: LiveServer) -> None:
    """The gate answers from the headers: a client announcing 500 MB and sending one byte
    gets its 401 at once (the rest of the body is never awaited)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
    writer.write(b"POST /v1/items HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 500000000\r\n\r\n{")
    await writer.drain()
    async with asyncio.timeout(5):
        status_line = await reader.readline()
    writer.close()
    assert status_line.startswith(b"HTTP/1.1 401 ")


async def test_methods_head_options_and_405(client: httpx.AsyncClient) -> None:
    head = await client.head("/v1/items")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == "application/json"
    options = await client.options("/v1/items")
    assert options.status_code == 204
    assert options.headers["allow"] == "GET, HEAD, OPTIONS, POST"
    wrong = await client.delete("/v1/runs")
    assert wrong.status_code == 405
    assert wrong.headers["allow"] == "GET, HEAD, OPTIONS, POST"
    assert wrong.headers["content-type"] == "application/problem+json"
    assert (await client.head("/healthz")).status_code == 200


# --- 14. never-retried items ----------------------------------------------------------------

async def test_an_item_never_retried_has_no_next_attempt(client: httpx.AsyncClient) -> None:
    await client.post("/v1/items", json={"items": [ITEM]})
    item = (await client.get("/v1/items")).json()["items"][0]
    assert item["next_attempt_at"] is None


# --- 15. the schema says what the server enforces -----------------------------------------

@pytest.mark.parametrize("body", [{"why": "x"}, {"ids": [], "why": "x"}, {"items": [], "why": "x"},
                                  {"policy": "", "why": "x"}, {"reason": None, "why": "x"},
                                  {"ids": None, "tenant_id": None, "why": "x"}])
async def test_a_selection_must_select_something(client: httpx.AsyncClient,
                                                 body: dict[str, Any]) -> None:
    """The server refuses what selects nothing (a null selector selects nothing), and the
    schema says so: some selector present and not null."""
    answer = await client.post("/v1/items/cancel", json=body)
    assert answer.status_code == 422
    schema = openapi_document()["components"]["schemas"]["ItemSelection"]  # type: ignore[index]
    assert schema["not"] == {"properties": {name: {"type": "null"} for name in (
        "ids", "items", "policy", "reason", "tenant_id")}}


@pytest.mark.parametrize("path", ["/v1/runs", "/v1/workers/pause", "/v1/scopes/tenant:a/pause"])
async def test_an_optional_body_is_left_out_or_an_object_never_null(
        client: httpx.AsyncClient, path: str) -> None:
    """An optional body is declared as the object itself (so generated clients can leave it
    out), and a JSON null, which that schema does not allow, is refused."""
    answer = await client.post(path, content=b"null",
                               headers={"Content-Type": "application/json"})
    assert answer.status_code == 422, answer.text
    assert answer.json()["errors"][0]["loc"] == ["body"]
    operation = openapi_document()["paths"][path.replace("tenant:a", "{scope}")]["post"]
    body = operation["requestBody"]  # type: ignore[index]
    assert "required" not in body and "$ref" in body["content"]["application/json"]["schema"]


async def test_integers_written_as_integral_numbers_are_integers(
        client: httpx.AsyncClient) -> None:
    await client.post("/v1/items", json={"items": [ITEM]})
    scope = f"tenant:{SHOP}"
    ok = await client.put(f"/v1/scopes/{scope}",
                          json={"rate_per_second": 5, "burst": 5.0, "weight": 2.0})
    assert ok.status_code == 200, ok.text
    assert (ok.json()["burst"], ok.json()["weight"]) == (5, 2)
    for bad in ({"burst": 5.5}, {"burst": True}, {"burst": "5"}):
        answer = await client.put(f"/v1/scopes/{scope}",
                                  json={"rate_per_second": 5, **bad})
        assert issues(answer)[0][0] == "body.burst"



@pytest.mark.parametrize("raw", [b"null", b'"text"', b"[1, 2]", b"7"])
async def test_a_webhook_body_must_be_a_json_object(live: LiveServer, raw: bytes) -> None:
    """Even for an event type no rule maps (which is otherwise answered `ignored`)."""
    async with live.client(None) as hooks:
        body, headers = shopify("products/update", None, raw=raw)
        answer = await post(hooks, "shopify", (body, headers))
    assert answer.status_code == 400
    assert answer.json()["type"] == "urn:sweeper:problem:malformed-webhook"


@pytest.mark.parametrize("rate", [5e-324, 1e-300, 0.0009, 100_000.5])
async def test_a_budget_outside_the_bucket_range_is_refused(client: httpx.AsyncClient,
                                                            rate: float) -> None:
    await client.post("/v1/items", json={"items": [ITEM]})
    answer = await client.put(f"/v1/scopes/tenant:{SHOP}",
                              json={"rate_per_second": rate, "burst": 5})
    assert issues(answer)[0][0] == "body.rate_per_second"
    assert (await client.get("/v1/scopes")).status_code == 200

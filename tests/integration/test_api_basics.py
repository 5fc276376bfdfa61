"""Health, readiness, auth and error shape over real HTTP against a real database."""

from __future__ import annotations

import base64
import json
import logging

import httpx
import pytest
from sqlalchemy import text
from starlette.requests import Request

from service.config.policies import Policies
from service.config.settings import async_url
from service.db import migrate
from service.db.engine import make_engine
from service.http.api import problems
from service.http.api.health import UNSIGNED_WARNING
from service.protocols.egress import public_roots
from tests.conftest import TOKEN_A, TOKEN_B, LiveServer, policies_from, test_settings


async def test_healthz_and_readyz(api: httpx.AsyncClient) -> None:
    """/healthz reports the schema revision read at start (it said null, always)."""
    assert (await api.get("/healthz")).json() == {"status": "ok",
                                                  "schema_revision": migrate.head_revision()}
    ready = await api.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["schema_revision"] == migrate.head_revision()


SIGNING_KEY = base64.b64encode(bytes(range(32))).decode()  # an Ed25519 private key's bytes


async def test_text_only_the_database_refuses_is_a_422_too(db_url: str) -> None:
    """The schemas refuse NUL characters and unpaired surrogates wherever they can; text that
    gets past them to PostgreSQL, which refuses it, is answered by the database errors'
    handler as the same clean 422, never a 500."""
    engine = make_engine(async_url(db_url), test_settings(db_url))
    try:
        with pytest.raises(Exception) as refused:  # noqa: PT011 - whatever the driver raises
            async with engine.connect() as conn:
                await conn.execute(text("SELECT CAST(:value AS text)"), {"value": "a\x00b"})
    finally:
        await engine.dispose()
    request = Request({"type": "http", "method": "GET", "path": "/v1/items", "headers": [],
                       "query_string": b"", "app": None})
    answer = await problems.on_database(request, refused.value)
    assert answer.status_code == 422
    assert json.loads(answer.body)["type"] == "urn:sweeper:problem:unstorable-text"


@pytest.mark.parametrize("key", [None, SIGNING_KEY])
async def test_readyz_and_the_start_log_say_when_exports_are_unsigned(
        db_url: str, key: str | None, caplog: pytest.LogCaptureFixture) -> None:
    """With a database URL and no signing key the process stays ready, and says at start
    and in every readiness answer that its evidence exports are unsigned."""
    with caplog.at_level(logging.WARNING, logger="service.http"):
        async with LiveServer(test_settings(db_url, evidence_signing_key=key),
                              Policies.empty(), db_url) as live:
            async with httpx.AsyncClient(verify=public_roots(), base_url=live.base_url) as client:
                ready = await client.get("/readyz")
    assert ready.status_code == 200
    warned = [r.getMessage() for r in caplog.records if "unsigned" in r.getMessage()]
    if key is None:
        assert ready.json()["evidence_signed"] is False
        assert ready.json()["warnings"] == [UNSIGNED_WARNING]
        assert warned == [UNSIGNED_WARNING]
    else:
        assert ready.json()["evidence_signed"] is True
        assert ready.json()["warnings"] == [] and warned == []


async def test_readyz_is_503_until_the_schema_is_at_head(empty_db_url: str) -> None:
    async with LiveServer(test_settings(empty_db_url), Policies.empty(), empty_db_url) as live:
        async with httpx.AsyncClient(verify=public_roots(), base_url=live.base_url) as client:
            response = await client.get("/readyz")
            assert response.status_code == 503
            assert response.headers["content-type"] == "application/problem+json"
            assert response.json()["type"] == "urn:sweeper:problem:schema-not-at-head"
            assert "Retry-After" in response.headers
            engine = make_engine(async_url(empty_db_url), test_settings(empty_db_url))
            await migrate.upgrade(engine)
            await engine.dispose()
            assert (await client.get("/readyz")).status_code == 200


async def test_readyz_is_503_when_the_database_is_unreachable() -> None:
    url = "postgresql://postgres@127.0.0.1:1/nowhere"
    async with LiveServer(test_settings(url), Policies.empty(), url) as live:
        async with httpx.AsyncClient(verify=public_roots(), base_url=live.base_url) as client:
            response = await client.get("/readyz")
            assert response.status_code == 503
            assert response.json()["type"] == "urn:sweeper:problem:database-unavailable"
            assert (await client.get("/healthz")).status_code == 200


@pytest.mark.parametrize("header", [None, "Bearer wrong-token-xxxxxxxxxx", f"Basic {TOKEN_A}",
                                    "Bearer", f"bearer{TOKEN_A}"])
async def test_v1_requires_a_valid_bearer_token(api: httpx.AsyncClient, header: str | None
                                                ) -> None:
    headers = {"Authorization": header} if header else {}
    async with httpx.AsyncClient(verify=public_roots(), base_url=str(api.base_url),
                                 headers=headers) as anon:
        response = await anon.get("/v1/policies")
    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert response.json()["type"] == "urn:sweeper:problem:unauthorized"


@pytest.mark.parametrize("token", [TOKEN_A, TOKEN_B])
async def test_either_rotation_token_is_accepted(api: httpx.AsyncClient, token: str) -> None:
    response = await api.get("/v1/policies", headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 200
    assert response.json() == {"source": "<none>", "policies": []}


async def test_unknown_path_is_a_problem(api: httpx.AsyncClient) -> None:
    response = await api.get("/v1/nothing-here")
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/problem+json"
    assert response.headers["x-request-id"]


async def test_readyz_stays_ready_on_a_newer_schema(db_url: str) -> None:
    """During a rolling upgrade the new release migrates first; old pods must stay ready."""
    import asyncpg

    async with LiveServer(test_settings(db_url), Policies.empty(), db_url) as live:
        async with httpx.AsyncClient(verify=public_roots(), base_url=live.base_url) as client:
            conn = await asyncpg.connect(db_url)
            try:
                await conn.execute(
                    "UPDATE alembic_version SET version_num = '9999_from_the_future'")
            finally:
                await conn.close()
            # /healthz never reads the database: the revision it saw at start, until a
            # readiness check reads the new one
            before = (await client.get("/healthz")).json()["schema_revision"]
            response = await client.get("/readyz")
            after = (await client.get("/healthz")).json()["schema_revision"]
    assert response.status_code == 200
    assert response.json()["schema_revision"] == "9999_from_the_future"
    assert (before, after) == (migrate.head_revision(), "9999_from_the_future")


@pytest.mark.parametrize(("method", "path", "body", "problem"), [
    # reasons (service/http/api/reasons.py), ids, policy names and query filters are refused
    # by the schema itself
    ("POST", "/v1/items/cancel", '{"ids": [1], "why": "a\\u0000b"}', "validation-error"),
    ("POST", "/v1/items/redrive", '{"tenant_id": "t", "why": "\\udfff"}', "validation-error"),
    ("POST", "/v1/items/cancel", '{"tenant_id": "a\\u0000b", "why": "x"}', "validation-error"),
    ("POST", "/v1/items/redrive", '{"policy": "\\ud800", "why": "x"}', "validation-error"),
    ("GET", "/v1/items?tenant_id=a%00b", None, "validation-error"),  # query filters too
    # the item model itself refuses an unpaired surrogate
    ("POST", "/v1/items", '{"items": [{"tenant_id": "t\\udfff", "object_id": "o", '
                          '"policy": "carts", "due_at": "2026-01-01T00:00:00Z"}]}',
     "validation-error"),
])
async def test_text_the_ledger_cannot_store_is_a_422(api: httpx.AsyncClient, method: str,
                                                     path: str, body: str | None,
                                                     problem: str) -> None:
    response = await api.request(method, path, content=body,
                                 headers={"Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["type"] == f"urn:sweeper:problem:{problem}", response.text


@pytest.mark.parametrize("key", [
    b"slot\t1",           # a tab is a legal header byte, and a control character
    b"slot-\x85",         # read as Latin-1: U+0085, a C1 control character
    b"\xe9" * 300,        # 300 characters, 600 bytes in UTF-8: over the 512-byte limit
])
async def test_an_idempotency_key_the_ledger_cannot_store_is_a_422(api: httpx.AsyncClient,
                                                                   key: bytes) -> None:
    response = await api.post("/v1/runs", json={}, headers={"Idempotency-Key": key})
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["type"] in ("urn:sweeper:problem:validation-error",
                                       "urn:sweeper:problem:invalid-idempotency-key")
    assert (await api.get("/v1/runs")).json()["runs"] == []  # nothing was recorded


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/runs", {"cutoff": 1767225600}),          # a number is not read as epoch seconds
    ("/v1/runs", {"max_items": "5"}),              # "5" is not 5
    ("/v1/runs", {"dry_run": 1}),                  # 1 is not true
    ("/v1/items/cancel", {"ids": ["1"], "why": "x"}),
])
async def test_values_must_have_the_declared_json_type(api: httpx.AsyncClient, path: str,
                                                       body: dict[str, object]) -> None:
    response = await api.post(path, json=body)
    assert response.status_code == 422, response.text
    assert response.json()["type"] == "urn:sweeper:problem:validation-error"


async def test_a_tenant_too_long_for_its_scope_is_a_422_naming_its_item(db_url: str) -> None:
    """Only the registration statement finds a scope over its byte limit; the answer still
    names the item and field, like the checks before it."""
    policy = {"version": 1, "upstream": "shop", "path": "/x/{object_id}",
              "scope": "tenant:{tenant_id}", "rate": {"per_second": 10, "burst": 10}}
    policies = policies_from({"upstreams": {"shop": {"base_url": "http://127.0.0.1:9"}},
                              "policies": {"carts": policy}})
    items = [{"tenant_id": tenant, "object_id": "c1", "policy": "carts",
              "due_at": "2026-01-01T00:00:00Z"} for tenant in ("acme", "a" * 512)]
    async with LiveServer(test_settings(db_url), policies, db_url) as live:
        async with httpx.AsyncClient(verify=public_roots(), base_url=live.base_url, headers={
                "Authorization": f"Bearer {TOKEN_A}"}) as client:
            response = await client.post("/v1/items", json={"items": items})
            listed = await client.get("/v1/items")
    assert response.status_code == 422, response.text
    assert [(e["loc"], e["type"]) for e in response.json()["errors"]] == [
        (["body", "items", "1", "tenant_id"], "scope_too_long")]
    assert listed.json()["items"] == []  # nothing was written

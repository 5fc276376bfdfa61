"""Roles through HTTP: a token's role decides what it may call on the API and in the
console, the refusal comes after authentication and before the body is read, and the
audit trail names the token by its id, never its secret."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.config.tokens import token_id
from service.protocols.egress import public_roots
from tests.conftest import TOKEN_A, LiveServer, test_settings
from tests.integration.test_console import Browser, sign_in
from tests.integration.test_pipeline import make_policies

OPERATOR = "test-token-operator-oooooooo"
VIEWER = "test-token-viewer-vvvvvvvvvvvv"
SCOPE = "/v1/scopes/tenant:acme"


@pytest.fixture
async def live(db_url: str) -> AsyncIterator[LiveServer]:
    """A server with one token per role (TOKEN_A is admin, as SWEEPER_API_TOKENS always
    meant) and a registered item, so scope tenant:acme exists."""
    settings = test_settings(db_url, api_tokens=TOKEN_A, operator_tokens=OPERATOR,
                             viewer_tokens=VIEWER)
    async with LiveServer(settings, make_policies("http://127.0.0.1:9"), db_url) as server:
        async with api(server, TOKEN_A) as admin:
            answer = await admin.post("/v1/items", json={"items": [
                {"tenant_id": "acme", "object_id": "cart-1", "policy": "carts",
                 "due_at": "2026-01-01T00:00:00Z"}]})
            assert answer.status_code == 200, answer.text
        yield server


def api(server: LiveServer, token: str) -> httpx.AsyncClient:
    return server.client(token)


def assert_refused(answer: httpx.Response, need: str, held: str) -> None:
    assert answer.status_code == 403, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    problem = answer.json()
    assert problem["type"] == "urn:sweeper:problem:insufficient-role"
    assert (problem["required_role"], problem["role"]) == (need, held)
    assert f"needs the {need} role" in problem["detail"]
    assert f"has the {held} role" in problem["detail"]


async def test_a_viewer_reads_and_is_refused_every_change(live: LiveServer) -> None:
    async with api(live, VIEWER) as viewer:
        for path in ("/v1/items", "/v1/runs", "/v1/scopes", "/v1/workers", "/v1/holds",
                     "/v1/policies"):
            assert (await viewer.get(path)).status_code == 200, path
        assert_refused(await viewer.post("/v1/runs", json={}), "operator", "viewer")
        assert_refused(await viewer.post("/v1/workers/pause", json={"reason": "x"}),
                       "operator", "viewer")
        assert_refused(await viewer.put(SCOPE, json={"rate_per_second": 1, "burst": 1}),
                       "operator", "viewer")
        assert_refused(await viewer.post("/v1/holds/1/release", json={"why": "x"}),
                       "admin", "viewer")
        # the role is refused before the body is parsed or the query checked: a body that
        # is not JSON, or an unknown parameter, still gets the 403
        assert_refused(await viewer.post("/v1/runs", content=b'{"x": ',
                                         headers={"Content-Type": "application/json"}),
                       "operator", "viewer")
        assert_refused(await viewer.post("/v1/items/cancel?bogus=1", json={}),
                       "operator", "viewer")
    async with api(live, TOKEN_A) as admin:
        workers = (await admin.get("/v1/workers")).json()
        assert workers["workers_paused"] is False  # nothing the viewer sent took effect


async def test_an_operator_runs_pauses_and_holds_but_releases_credentials_and_closures_need_admin(
        live: LiveServer) -> None:
    async with api(live, OPERATOR) as operator:
        run = await operator.post("/v1/runs", json={"dry_run": True})
        assert run.status_code == 202, run.text
        assert (await operator.post(f"{SCOPE}/pause", json={"reason": "window"})
                ).status_code == 200
        assert_refused(await operator.post(f"{SCOPE}/resume", json={"lift_closure": True}),
                       "admin", "operator")
        scopes = (await operator.get("/v1/scopes")).json()["scopes"]
        assert scopes[0]["paused"] is True  # the refused resume changed nothing
        assert (await operator.post(f"{SCOPE}/resume", json={"reason": "done"})
                ).status_code == 200
        assert_refused(await operator.put("/v1/tenants/acme/credentials/shop",
                                          json={"secret": "s" * 20}), "admin", "operator")
        assert_refused(await operator.delete("/v1/tenants/acme/credentials/shop"),
                       "admin", "operator")
    async with api(live, TOKEN_A) as admin:
        async with api(live, OPERATOR) as operator:
            # placing a hold keeps more (the safe side): an operator may; releasing is admin
            hold = await operator.post("/v1/holds", json={
                "tenant_id": "acme", "reason": "case", "reference": "C-1"})
            assert hold.status_code == 201, hold.text
            assert_refused(await operator.post(f"/v1/holds/{hold.json()['id']}/release",
                                               json={"why": "settled"}), "admin", "operator")
        released = await admin.post(f"/v1/holds/{hold.json()['id']}/release",
                                    json={"why": "settled"})
        assert released.status_code == 200, released.text
        assert (await admin.post(f"{SCOPE}/resume", json={"lift_closure": True})
                ).status_code == 200


async def test_the_audit_trail_names_each_token_by_its_id(live: LiveServer,
                                                          engine: AsyncEngine) -> None:
    for token, reason in ((TOKEN_A, "by admin"), (OPERATOR, "by operator")):
        async with api(live, token) as client:
            answer = await client.post(f"{SCOPE}/pause", json={"reason": reason})
            assert answer.status_code == 200, answer.text
    async with engine.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT actor, reason, details::text AS details FROM operator_actions "
            "WHERE action = 'scope.pause' ORDER BY id"))).all()
    assert [(r.actor, r.reason) for r in rows] == [
        (token_id(TOKEN_A), "by admin"), (token_id(OPERATOR), "by operator")]
    assert re.fullmatch(r"token:[0-9a-f]{8}", rows[0].actor)
    assert not any(secret in r.actor + r.details for r in rows
                   for secret in (TOKEN_A, OPERATOR))


async def test_the_console_shows_a_viewer_no_forms_and_refuses_them(live: LiveServer) -> None:
    async with live.client(None) as client:
        assert (await sign_in(client, VIEWER)).status_code == 303
        browser = Browser(client)
        overview = await client.get("/console")
        assert f"{token_id(VIEWER)} (viewer)" in overview.text
        assert 'action="/console/runs"' not in overview.text
        scopes = await client.get("/console/scopes")
        assert 'action="/console/workers/' not in scopes.text
        scope = await client.get("/console/scope", params={"name": "tenant:acme"})
        assert "/console/scope/pause" not in scope.text
        assert "/console/scope/budget" not in scope.text
        items = await client.get("/console/items")
        assert 'action="/console/items/action"' not in items.text
        assert 'name="id"' not in items.text
        csrf = await browser.csrf()  # the sign-out form carries it
        for path, form in (("/runs", {}), ("/workers/pause", {"reason": "x"}),
                           ("/scope/pause", {"name": "tenant:acme"}),
                           ("/items/action", {"action": "cancel", "target": "filter",
                                              "why": "x", "step": "confirm"})):
            refused = await browser.post(path, {"csrf": csrf, **form})
            assert refused.status_code == 403, (path, refused.text)
            assert "needs the operator role" in refused.text
            assert "has the viewer role" in refused.text
    async with api(live, TOKEN_A) as admin:
        state = await admin.get("/v1/scopes")
        assert state.json()["scopes"][0]["paused"] is False
        assert (await admin.get("/v1/runs")).json()["runs"] == []
        assert (await admin.get("/v1/items", params={"status": "pending"})
                ).json()["items"][0]["status"] == "pending"


async def test_the_console_lets_an_operator_resume_but_not_lift_a_closure(
        live: LiveServer) -> None:
    async with live.client(None) as client:
        assert (await sign_in(client, OPERATOR)).status_code == 303
        browser = Browser(client)
        csrf = await browser.csrf()
        assert 'action="/console/runs"' in (await client.get("/console")).text
        paused = await browser.post("/scope/pause", {"csrf": csrf, "name": "tenant:acme"})
        assert paused.status_code == 303, paused.text
        scope = await client.get("/console/scope", params={"name": "tenant:acme"})
        assert "/console/scope/resume" in scope.text
        assert 'name="lift_closure"' not in scope.text
        refused = await browser.post("/scope/resume", {
            "csrf": csrf, "name": "tenant:acme", "lift_closure": "on"})
        assert refused.status_code == 403, refused.text
        assert "needs the admin role" in refused.text
        resumed = await browser.post("/scope/resume", {"csrf": csrf, "name": "tenant:acme"})
        assert resumed.status_code == 303, resumed.text
    async with live.client(None) as client:
        assert (await sign_in(client, TOKEN_A)).status_code == 303
        await Browser(client).post("/scope/pause", {"csrf": await Browser(client).csrf(),
                                                    "name": "tenant:acme"})
        scope = await client.get("/console/scope", params={"name": "tenant:acme"})
        assert 'name="lift_closure"' in scope.text


async def test_a_session_follows_its_tokens_role(db_url: str) -> None:
    """Moving a token to a lower role's setting lowers its console sessions at once."""
    policies = make_policies("http://127.0.0.1:9")
    async with httpx.AsyncClient(verify=public_roots(), timeout=10) as client:
        async with LiveServer(test_settings(db_url, api_tokens=TOKEN_A,
                                            operator_tokens=OPERATOR), policies,
                              db_url) as server:
            client.base_url = httpx.URL(server.base_url)
            assert (await sign_in(client, OPERATOR)).status_code == 303
            assert 'action="/console/runs"' in (await client.get("/console")).text
        async with LiveServer(test_settings(db_url, api_tokens=TOKEN_A,
                                            viewer_tokens=OPERATOR), policies,
                              db_url) as server:
            client.base_url = httpx.URL(server.base_url)
            page = await client.get("/console")
            assert page.status_code == 200
            assert "(viewer)" in page.text and 'action="/console/runs"' not in page.text

"""One rule for every free-text reason, through HTTP: the API and the console refuse a
line break, any other control character, a line separator, an empty text and one past the
bound, with a 422 naming the field, and change nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from service.http.api.reasons import MAX_REASON_CHARS, MAX_REFERENCE_CHARS
from tests.conftest import LiveServer, test_settings
from tests.integration.test_console import Browser, sign_in
from tests.integration.test_pipeline import make_policies

BAD_TEXT = {"line feed": "first\nsecond", "carriage return": "a\rb", "tab": "a\tb",
            "NUL": "a\x00b", "DEL": "a\x7fb", "C1 next line": "a\x85b",
            "line separator": "a\u2028b", "paragraph separator": "a\u2029b", "empty": ""}
HOLD = {"tenant_id": "acme", "reason": "case", "reference": "C-1"}
# (method, path, a valid body, the free-text field in it, its bound)
FIELDS: list[tuple[str, str, dict[str, Any], str, int]] = [
    ("POST", "/v1/holds", HOLD, "reason", MAX_REASON_CHARS),
    ("POST", "/v1/holds", HOLD, "reference", MAX_REFERENCE_CHARS),
    ("POST", "/v1/holds/1/release", {"why": "settled"}, "why", MAX_REASON_CHARS),
    ("POST", "/v1/scopes/tenant:acme/pause", {"reason": "x"}, "reason", MAX_REASON_CHARS),
    ("POST", "/v1/scopes/tenant:acme/resume", {"reason": "x"}, "reason", MAX_REASON_CHARS),
    ("PUT", "/v1/scopes/tenant:acme", {"rate_per_second": 1, "burst": 1, "reason": "x"},
     "reason", MAX_REASON_CHARS),
    ("POST", "/v1/workers/pause", {"reason": "x"}, "reason", MAX_REASON_CHARS),
    ("POST", "/v1/workers/resume", {"reason": "x"}, "reason", MAX_REASON_CHARS),
    ("PUT", "/v1/tenants/acme/credentials/shop", {"secret": "s" * 20, "reason": "x"},
     "reason", MAX_REASON_CHARS),
    ("POST", "/v1/items/redrive", {"ids": [1], "why": "x"}, "why", MAX_REASON_CHARS),
    ("POST", "/v1/items/cancel", {"ids": [1], "why": "x"}, "why", MAX_REASON_CHARS),
]


@pytest.fixture
async def live(db_url: str) -> AsyncIterator[LiveServer]:
    async with LiveServer(test_settings(db_url), make_policies("http://127.0.0.1:9"),
                          db_url) as server:
        async with server.client() as api:
            answer = await api.post("/v1/items", json={"items": [
                {"tenant_id": "acme", "object_id": "cart-1", "policy": "carts",
                 "due_at": "2026-01-01T00:00:00Z"}]})
            assert answer.status_code == 200, answer.text
        yield server


def assert_names(answer: httpx.Response, field: str) -> None:
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert [e["loc"] for e in answer.json()["errors"]] == [["body", field]], answer.text


async def test_every_reason_of_the_api_follows_one_rule(live: LiveServer) -> None:
    async with live.client() as api:
        for method, path, body, field, bound in FIELDS:
            for name, bad in {**BAD_TEXT, "too long": "x" * (bound + 1)}.items():
                answer = await api.request(method, path, json={**body, field: bad})
                assert answer.status_code == 422, (path, field, name)
                assert_names(answer, field)
            # the bound itself, and any printable text, are kept
            assert (await api.post("/v1/workers/pause", json={
                "reason": "ünïcode ✓ " + "x" * (MAX_REASON_CHARS - 10)})).status_code == 200
        workers = await api.get("/v1/workers")
        assert workers.json()["paused_reason"].startswith("ünïcode ✓ ")
        scopes = (await api.get("/v1/scopes")).json()["scopes"]
        assert scopes[0]["paused"] is False and scopes[0]["rate_per_second"] != 1
        assert (await api.get("/v1/holds")).json()["holds"] == []


async def test_the_consoles_reasons_follow_the_same_rule(live: LiveServer) -> None:
    async with live.client(None) as client:
        assert (await sign_in(client)).status_code == 303
        browser = Browser(client)
        csrf = await browser.csrf()
        forms = [("/workers/pause", {}, "reason"),
                 ("/scope/pause", {"name": "tenant:acme"}, "reason"),
                 ("/items/action", {"action": "cancel", "target": "filter"}, "why")]
        for path, form, field in forms:
            for name, bad in {**BAD_TEXT, "too long": "x" * (MAX_REASON_CHARS + 1)}.items():
                if bad == "":
                    continue  # an empty field is no reason given
                answer = await browser.post(path, {"csrf": csrf, **form, field: bad})
                assert answer.status_code == 422, (path, name, answer.text)
                assert field in answer.text, (path, name)
        budget = await browser.post("/scope/budget", {
            "csrf": csrf, "name": "tenant:acme", "rate_per_second": "1", "burst": "1",
            "reason": "a\u2028b"})
        assert budget.status_code == 422 and "reason" in budget.text
    async with live.client() as api:
        assert (await api.get("/v1/workers")).json()["workers_paused"] is False
        scope = (await api.get("/v1/scopes")).json()["scopes"][0]
        assert scope["paused"] is False and scope["rate_per_second"] != 1
        pending = await api.get("/v1/items", params={"status": "pending"})
        assert len(pending.json()["items"]) == 1

"""Resuming a scope lifts a pause, not the upstream's word: a closure a 429 imposed stays
until `closed_until` unless the operator overrides it with `lift_closure`, which the audit
trail records. Over real HTTP against a real database."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.budget import buckets, rules
from tests.conftest import LiveServer, test_settings
from tests.fakes.upstream import FakeUpstream, Fault
from tests.integration.db_clock import advance
from tests.integration.test_pipeline import make_policies, register

SCOPE = "tenant:acme"


@pytest.fixture
async def client(db_url: str, engine: AsyncEngine) -> AsyncIterator[httpx.AsyncClient]:
    """A replica (API only) whose ledger has the scope `tenant:acme`, with 3 items."""
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 3)
    async with LiveServer(test_settings(db_url), policies, db_url) as live:
        async with live.client() as client:
            yield client


async def close(engine: AsyncEngine, delay_s: float | None, times: int = 1) -> None:
    """Close the scope as a 429 does: until `delay_s` from now (a Retry-After), or (None)
    by its backoff, which grows with each such 429 after the closure before it ended."""
    for n in range(times):
        if n:
            async with engine.begin() as conn:  # the closure before this 429 has ended
                await conn.execute(text("UPDATE scopes SET closed_until = now() - "
                                        "interval '1 s' WHERE name = :n"), {"n": SCOPE})
        await buckets.close(engine, {SCOPE: rules.Closure(delay_s, 60.0, 120.0)})


async def last_action(engine: AsyncEngine) -> tuple[str, str | None, dict[str, Any]]:
    async with engine.connect() as conn:
        row = (await conn.execute(text(
            "SELECT action, reason, details FROM operator_actions ORDER BY id DESC LIMIT 1"))
        ).one()
    return row.action, row.reason, row.details


def moment(value: str) -> datetime:
    return datetime.fromisoformat(value)


async def test_a_resume_keeps_the_upstreams_closure(client: httpx.AsyncClient,
                                                    engine: AsyncEngine) -> None:
    assert (await client.post(f"/v1/scopes/{SCOPE}/pause", json={"reason": "migrating"})
            ).status_code == 200
    await close(engine, 600)
    resumed = await client.post(f"/v1/scopes/{SCOPE}/resume", json={"reason": "migration done"})
    assert resumed.status_code == 200, resumed.text
    scope = resumed.json()
    assert scope["paused"] is False and scope["paused_reason"] is None
    # still closed, and the answer says until when
    closed_until = moment(scope["closed_until"])
    assert closed_until > datetime.now(UTC) + timedelta(seconds=590)
    listed = (await client.get("/v1/scopes")).json()["scopes"]
    assert [s["closed_until"] for s in listed if s["name"] == SCOPE] == [scope["closed_until"]]
    assert await last_action(engine) == ("scope.resume", "migration done", {
        "scope": SCOPE, "lift_closure": False, "closed_until": closed_until.isoformat(),
        "backoff_level": 0})


async def test_lift_closure_ends_the_closure_and_its_backoff(client: httpx.AsyncClient,
                                                             engine: AsyncEngine) -> None:
    # closed by its backoff after two 429s without a date, and not paused
    await close(engine, None, times=2)
    before = (await client.get("/v1/scopes")).json()["scopes"][0]
    assert before["paused"] is False and before["backoff_level"] == 2
    assert moment(before["closed_until"]) > datetime.now(UTC)
    resumed = await client.post(f"/v1/scopes/{SCOPE}/resume", json={
        "reason": "upstream reset our limit", "lift_closure": True})
    assert resumed.status_code == 200, resumed.text
    scope = resumed.json()
    assert (scope["closed_until"], scope["backoff_level"], scope["paused"]) == (None, 0, False)
    assert await last_action(engine) == ("scope.resume", "upstream reset our limit", {
        "scope": SCOPE, "lift_closure": True,
        "closed_until": moment(before["closed_until"]).isoformat(), "backoff_level": 2})
    # the bucket refills from the lift, not from the end of the closure it lifted
    await advance(engine, 0.05, scopes=[SCOPE])
    refilled = (await client.get("/v1/scopes")).json()["scopes"][0]
    assert refilled["tokens"] > 0


async def test_lifting_no_closure_changes_nothing_but_the_pause(client: httpx.AsyncClient,
                                                                engine: AsyncEngine) -> None:
    await client.post(f"/v1/scopes/{SCOPE}/pause")
    resumed = await client.post(f"/v1/scopes/{SCOPE}/resume", json={"lift_closure": True})
    assert resumed.status_code == 200
    assert (resumed.json()["paused"], resumed.json()["closed_until"]) == (False, None)
    assert await last_action(engine) == ("scope.resume", None, {
        "scope": SCOPE, "lift_closure": True, "closed_until": None, "backoff_level": 0})


@pytest.mark.parametrize("body", [{"lift_closure": "true"}, {"lift_closure": 1},
                                  {"lift_closure": None}, {"lift": True},
                                  {"reason": "x" * 1001}])
async def test_the_resume_body_is_strict(client: httpx.AsyncClient, engine: AsyncEngine,
                                         body: dict[str, Any]) -> None:
    await close(engine, 600)
    answer = await client.post(f"/v1/scopes/{SCOPE}/resume", json=body)
    assert answer.status_code == 422, answer.text
    scope = (await client.get("/v1/scopes")).json()["scopes"][0]
    assert scope["closed_until"] is not None  # nothing was lifted


async def test_an_unknown_scope_is_404(client: httpx.AsyncClient) -> None:
    answer = await client.post("/v1/scopes/tenant:nobody/resume", json={"lift_closure": True})
    assert answer.status_code == 404


@pytest.mark.slow
@pytest.mark.parametrize("retry_after", [None, "600"])
async def test_a_scope_a_429_closed_calls_again_only_when_lifted(db_url: str,
                                                                 retry_after: str | None
                                                                 ) -> None:
    """With a date or without one: the worker that heard the 429 holds the scope only until
    the database closure is in place, so a lift reaches it as it reaches every replica."""
    async with FakeUpstream() as upstream:
        # one call at a time (the 429 closes the scope before the next token is due), and
        # a 429 closes it for 600 s: by its date, or by the scope's backoff without one
        policies = make_policies(upstream.base_url, rate={"per_second": 2, "burst": 1},
                                 backoff={"base_seconds": 600, "max_seconds": 1200})
        upstream.inject(Fault.STATUS, status=429,
                        headers={"Retry-After": retry_after} if retry_after else {})
        async with LiveServer(test_settings(db_url, workers=2), policies, db_url) as live:
            async with live.client() as api:
                await api.post("/v1/items", json={"items": [
                    {"tenant_id": "acme", "object_id": f"o{i}", "policy": "carts",
                     "due_at": "2026-01-01T00:00:00Z"} for i in range(3)]})
                run = (await api.post("/v1/runs", json={})).json()
                for _ in range(200):
                    scope = (await api.get("/v1/scopes")).json()["scopes"][0]
                    if scope["closed_until"]:
                        break
                    await asyncio.sleep(0.05)
                assert moment(scope["closed_until"]) > datetime.now(UTC) + \
                    timedelta(seconds=590)
                assert scope["backoff_level"] == (0 if retry_after else 1)
                kept = await api.post(f"/v1/scopes/{SCOPE}/resume", json={"reason": "oops"})
                assert kept.json()["closed_until"] == scope["closed_until"]
                await asyncio.sleep(1.5)  # a time to watch for calls, which must not come
                assert len(upstream.calls()) == 1  # the 429 only
                lifted = await api.post(f"/v1/scopes/{SCOPE}/resume", json={
                    "reason": "upstream reset our limit", "lift_closure": True})
                assert (lifted.json()["closed_until"], lifted.json()["backoff_level"]) == \
                    (None, 0)
                for _ in range(200):
                    body = (await api.get(f"/v1/runs/{run['id']}")).json()
                    if body["items"].get("succeeded", 0) >= 2:
                        break
                    await asyncio.sleep(0.05)
                # the items the 429 did not answer are called; the one it answered waits
                # out its own retry time (up to the policy's backoff)
                assert body["items"].get("succeeded", 0) >= 2
                assert body["attempts"].get("throttled") == 1

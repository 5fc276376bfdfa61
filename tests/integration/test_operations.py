"""Operator surface over real HTTP: inspect dead items, re-drive them, cancel pending ones,
export a run's evidence."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from service.ledger import registration
from tests.conftest import LiveServer, test_settings
from tests.fakes.upstream import FakeUpstream, Fault
from tests.integration.test_pipeline import make_policies

DUE = "2026-01-01T00:00:00Z"


@pytest.fixture
async def setup(db_url: str) -> AsyncIterator[tuple[httpx.AsyncClient, FakeUpstream, str]]:
    async with FakeUpstream() as upstream:
        policies = make_policies(upstream.base_url, max_attempts=2)
        async with LiveServer(test_settings(db_url, workers=4), policies, db_url) as live:
            live.count_progress_afresh()
            async with live.client() as api:
                yield api, upstream, db_url


async def wait_run_done(api: httpx.AsyncClient, run_id: int) -> dict[str, Any]:
    for _ in range(300):
        run = (await api.get(f"/v1/runs/{run_id}")).json()
        items = run["items"]
        if run["state"] == "published" and not items.get("pending") and not items.get("leased"):
            return dict(run)
        await asyncio.sleep(0.05)
    raise AssertionError(f"run {run_id} did not finish: {run}")


def entries(n: int, prefix: str = "c") -> list[dict[str, str]]:
    return [{"tenant_id": "acme", "object_id": f"{prefix}{i}", "policy": "carts", "due_at": DUE}
            for i in range(n)]


@pytest.mark.slow
async def test_dead_items_listed_redriven_and_audited(setup: Any) -> None:
    api, upstream, db_url = setup
    await api.post("/v1/items", json={"items": entries(6)})
    # the first 3 calls fail permanently
    upstream.inject(Fault.STATUS, times=3, status=422)
    run = (await api.post("/v1/runs", json={})).json()
    done = await wait_run_done(api, run["id"])
    assert done["items"] == {"succeeded": 3, "dead": 3}

    dead = (await api.get("/v1/items", params={"status": "dead", "policy": "carts",
                                               "reason": "http_422"})).json()
    assert len(dead["items"]) == 3 and dead["next_after"] is None
    assert {i["dead_reason"] for i in dead["items"]} == {"http_422"}
    page = (await api.get("/v1/items", params={"status": "dead", "limit": 2})).json()
    assert len(page["items"]) == 2 and page["next_after"] is not None
    rest = (await api.get("/v1/items", params={"status": "dead", "limit": 2,
                                               "after": page["next_after"]})).json()
    assert len(rest["items"]) == 1

    empty = await api.post("/v1/items/redrive", json={"why": "everything"})
    assert empty.status_code == 422
    redriven = await api.post("/v1/items/redrive", json={"reason": "http_422",
                                                         "why": "validation rule fixed"})
    assert redriven.status_code == 200 and redriven.json()["count"] == 3
    done = await wait_run_done(api, run["id"])
    assert done["items"] == {"succeeded": 6}

    conn = await asyncpg.connect(db_url)
    try:
        # the run that released them is in the audit trail too (run.trigger)
        action = await conn.fetchrow("SELECT actor, action, reason, details FROM "
                                     "operator_actions WHERE action = 'redrive'")
        attempts = await conn.fetchval("SELECT count(*) FROM attempts")
    finally:
        await conn.close()
    assert action["action"] == "redrive" and action["reason"] == "validation rule fixed"
    assert action["actor"].startswith("token:")
    assert json.loads(action["details"])["count"] == 3
    # 3 dead attempts kept in the audit trail; the 6 successes are on their items
    assert attempts == 3


async def test_cancel_withdraws_pending_items_only(setup: Any) -> None:
    api, upstream, _ = setup
    await api.post("/v1/items", json={"items": entries(4)})
    cancelled = await api.post("/v1/items/cancel", json={
        "items": [{"tenant_id": "acme", "object_id": "c0", "policy": "carts"}],
        "ids": [999999], "why": "customer withdrew request"})
    assert cancelled.status_code == 200 and cancelled.json()["count"] == 1
    run = (await api.post("/v1/runs", json={})).json()
    done = await wait_run_done(api, run["id"])
    assert done["items"] == {"succeeded": 3}
    assert {c.path for c in upstream.calls()} == {"/carts/c1", "/carts/c2", "/carts/c3"}
    again = await api.post("/v1/items/cancel", json={"policy": "carts", "why": "late"})
    assert again.json()["count"] == 0  # nothing pending any more
    listed = (await api.get("/v1/items", params={"status": "cancelled"})).json()
    assert [i["object_id"] for i in listed["items"]] == ["c0"]


async def test_evidence_lists_exactly_the_succeeded_items(setup: Any) -> None:
    api, upstream, _ = setup
    await api.post("/v1/items", json={"items": entries(5)})
    upstream.inject(Fault.STATUS, times=1, status=400)
    run = (await api.post("/v1/runs", json={})).json()
    await wait_run_done(api, run["id"])
    response = await api.get(f"/v1/runs/{run['id']}/evidence")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/x-ndjson")
    *lines, manifest = [json.loads(line) for line in response.text.splitlines()]
    records = [line for line in lines if "item_id" in line]  # not the checkpoints
    assert len(records) == 4 and manifest["manifest"]["records"] == 4
    dead = (await api.get("/v1/items", params={"status": "dead"})).json()["items"]
    assert {r["object_id"] for r in records} | {dead[0]["object_id"]} == {
        f"c{i}" for i in range(5)}
    for r in records:
        assert r["operation_key"] == registration.operation_key("acme", r["object_id"], "carts", 1)
        assert r["outcome"] == "succeeded" and r["upstream_status"] == 204
        assert r["policy_version"] == 1 and r["attempts"] == 1 and r["completed_at"]
    assert (await api.get("/v1/runs/424242/evidence")).status_code == 404

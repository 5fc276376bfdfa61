"""One run's publication failure never holds up the others: the publisher (the real lifespan
loop behind a live server) publishes runs in id order, so a run that raised on every pass
used to block every later run, of every policy."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx
import pytest
from sqlalchemy import text

from service.config.policies import Policies
from service.config.settings import async_url
from service.db.engine import make_engine
from service.ledger import registration
from service.observability import metrics
from service.runs import publication
from service.runs import trigger as runs_trigger
from tests.conftest import LiveServer, policies_from, test_settings

DUE = "2026-01-01T00:00:00Z"
CUTOFF = datetime(2026, 6, 1, tzinfo=UTC)


def two_policies() -> Policies:
    """`carts` and `exports`; no workers run, so the upstream is never called."""
    policy = {"version": 1, "upstream": "shop", "path": "/x/{object_id}",
              "scope": "tenant:{tenant_id}", "rate": {"per_second": 10, "burst": 10}}
    return policies_from({"upstreams": {"shop": {"base_url": "http://127.0.0.1:9"}},
                          "policies": {"carts": policy, "exports": policy}})


def entries(policy: str, n: int) -> list[dict[str, str]]:
    return [{"tenant_id": "acme", "object_id": f"{policy}-{i}", "policy": policy,
             "due_at": DUE} for i in range(n)]


@pytest.fixture
async def api(db_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with LiveServer(test_settings(db_url), two_policies(), db_url) as live:
        async with live.client() as client:
            yield client


async def settled(api: httpx.AsyncClient, run_id: int, timeout_s: float = 8.0
                  ) -> dict[str, Any]:
    """The run once it has left `publishing` (the publisher answers within a pass)."""
    async with asyncio.timeout(timeout_s):
        while True:
            response = await api.get(f"/v1/runs/{run_id}")
            assert response.status_code == 200, response.text
            run: dict[str, Any] = response.json()
            if run["state"] != "publishing":
                return run
            await asyncio.sleep(0.05)


async def trigger(api: httpx.AsyncClient, body: dict[str, Any]) -> int:
    response = await api.post("/v1/runs", json=body)
    assert response.status_code == 202, response.text
    return int(response.json()["id"])


async def test_a_due_at_python_cannot_hold_still_publishes_and_reports(
        api: httpx.AsyncClient, db_url: str) -> None:
    # stored as '0001-12-31 10:00:00+00 BC', which asyncpg cannot decode into a datetime.
    # The schema refuses such a value now (items_due_at_range): the constraint is dropped
    # here to show that publication copes with one all the same.
    conn = await asyncpg.connect(db_url)
    try:
        await conn.execute("ALTER TABLE items DROP CONSTRAINT IF EXISTS items_due_at_range")
        await conn.execute(
            "INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key,"
            " scope, due_at) VALUES ('acme', 'ancient', 'carts', 1, $1, 'tenant:acme',"
            " '0001-01-01T00:00:00+14:00')", registration.operation_key("acme", "ancient", "carts",
                                                                        1))
    finally:
        await conn.close()
    assert (await api.post("/v1/items", json={"items": entries("carts", 2)})).status_code == 200
    covering = await trigger(api, {"policy": "carts"})
    assert (await api.post("/v1/items", json={"items": entries("exports", 3)})).status_code == 200
    later = await trigger(api, {"policy": "exports"})

    run = await settled(api, covering)
    assert run["state"] == "published" and run["released"] == 3
    figures = run["report"]["policies"]["carts"]
    # the report keeps the database's exact value; the typed column holds the earliest
    # instant Python can, so every reader of the run row can still decode it
    assert figures == {"candidates": 3, "oldest_due_at": "0001-12-31T10:00:00+00:00 BC",
                       "newest_due_at": "2026-01-01T00:00:00+00:00", "held": 0}
    assert run["oldest_due_at"] == "0001-01-01T00:00:00Z"
    assert run["oldest_remaining_due_at"] == "0001-01-01T00:00:00Z"
    assert run["items"] == {"pending": 3}
    after = await settled(api, later)
    assert after["state"] == "published" and after["released"] == 3
    assert after["items"] == {"pending": 3}


def runs_failed() -> float:
    return metrics.REGISTRY.get_sample_value("sweeper_runs_failed_total") or 0.0


async def test_a_failing_run_is_failed_logged_once_and_later_runs_publish(
        api: httpx.AsyncClient, db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    failed_before = runs_failed()
    # The failure comes from the data: a batch with the identity the run's only batch will
    # have exists already, so releasing it violates batches' unique digest on every try.
    assert (await api.post("/v1/items", json={"items": [
        {"tenant_id": "acme", "object_id": "secret-cart-77", "policy": "carts",
         "due_at": DUE}]})).status_code == 200
    conn = await asyncpg.connect(db_url)
    try:
        item_id = await conn.fetchval("SELECT id FROM items WHERE object_id = 'secret-cart-77'")
        other = await conn.fetchval(
            "INSERT INTO runs (request_digest, cutoff, state, published_at)"
            " VALUES ('earlier', $1, 'published', now()) RETURNING id", CUTOFF)
        await conn.execute(
            "INSERT INTO batches (run_id, seq, digest, policy, policy_version, item_count)"
            " VALUES ($1, 0, $2, 'carts', 1, 1)", other,
            publication.batch_digest("carts", 1, CUTOFF, [item_id]))
    finally:
        await conn.close()
    failing = await trigger(api, {"policy": "carts", "cutoff": CUTOFF.isoformat()})
    assert (await api.post("/v1/items", json={"items": entries("exports", 3)})).status_code == 200
    later = await trigger(api, {"policy": "exports"})

    run = await settled(api, failing)
    assert run["state"] == "failed" and run["published_at"] is None and run["released"] == 0
    error = run["report"]["error"]
    assert error["code"] == "database-error"
    assert "UniqueViolationError" in error["message"] and "23505" in error["message"]
    assert "secret-cart-77" not in str(run["report"]) and str(item_id) not in error["message"]
    assert run["report"]["policies"]["carts"]["candidates"] == 1  # recorded before it failed
    after = await settled(api, later)
    assert after["state"] == "published" and after["released"] == 3
    assert after["items"] == {"pending": 3}

    # two more passes (each trigger wakes the publisher; its run published shows the pass
    # ran, and a pass the poll starts runs the same code): no retry
    for _ in range(2):
        assert (await settled(api, await trigger(api, {"policy": "exports"})))["state"] == \
            "published"
    assert (await settled(api, failing))["state"] == "failed"
    failures = [r for r in caplog.records if r.getMessage() == "run publication failed"]
    assert [getattr(r, "run_id", None) for r in failures] == [failing]
    assert failures[0].exc_info is not None
    assert not [r for r in caplog.records if r.getMessage() == "publisher failed"]
    assert runs_failed() == failed_before + 1  # counted once, as logged


async def test_a_busy_database_leaves_the_run_publishing_for_the_next_pass(
        db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(async_url(db_url), test_settings(db_url, db_statement_timeout_ms=200))
    holder = await asyncpg.connect(db_url)
    try:
        pol = two_policies().policies["carts"]
        await registration.register(engine, [registration.Registration("acme", "c1", pol, CUTOFF)])
        run_id, _ = await runs_trigger.create_run(
            engine, runs_trigger.RunRequest("carts", None, None, False, None), None)
        # a lock that makes the batch insert wait past the statement timeout (SQLSTATE 57014)
        tx = holder.transaction()
        await tx.start()
        await holder.execute("LOCK TABLE batches IN SHARE MODE")
        assert await publication.publish_pending(engine, batch_size=50) == 0
        await tx.rollback()
        async with engine.connect() as conn:
            row = (await conn.execute(text("SELECT state, error, report ? 'error' AS reported "
                                           "FROM runs WHERE id = :id"), {"id": run_id})).one()
        assert tuple(row) == ("publishing", None, False)
        deferred = [r for r in caplog.records if r.getMessage().startswith(
            "run publication deferred")]
        assert len(deferred) == 1 and getattr(deferred[0], "run_ids", None) == [run_id]

        assert await publication.publish_pending(engine, batch_size=50) == 1
        async with engine.connect() as conn:
            state = (await conn.execute(text("SELECT state FROM runs WHERE id = :id"),
                                        {"id": run_id})).scalar_one()
        assert state == "published"
    finally:
        await holder.close()
        await engine.dispose()

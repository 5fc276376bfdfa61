"""The store's own database as source and target, end to end: discovery by the production
predicate, report-only first, deletion in bounded batches that re-check the cutoff, and the
next run collecting what a paused schedule left behind (docs/stores.md, the worked example)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from tests.conftest import TOKEN_A, LiveServer, test_settings
from tests.integration.store_schema import create_store, store_policies


@pytest.fixture
async def store(store_db_url: str) -> AsyncIterator[asyncpg.Connection]:
    await create_store(store_db_url)
    conn = await asyncpg.connect(store_db_url)
    yield conn
    await conn.close()


async def wait_run(client: httpx.AsyncClient, run_id: int, *, drained: bool,
                   timeout_s: float = 20) -> dict[str, Any]:
    async with asyncio.timeout(timeout_s):
        while True:
            run = (await client.get(f"/v1/runs/{run_id}")).json()
            unfinished = sum(run["items"].get(s, 0) for s in ("pending", "leased", "held"))
            if run["state"] != "publishing" and (not drained or not unfinished):
                return run
            await asyncio.sleep(0.05)


async def test_report_only_then_delete_then_collect_what_was_left(
        db_url: str, store_db_url: str, store: asyncpg.Connection) -> None:
    # 60 expired carts over three shops, 5 active ones, and abandoned checkouts
    await store.execute("INSERT INTO carts (shop, updated_at) SELECT 'shop-' || (i % 3), "
                        "now() - interval '30 days' - i * interval '1 minute' "
                        "FROM generate_series(1, 60) i")
    await store.execute("INSERT INTO carts (shop, updated_at) SELECT 'shop-0', now() "
                        "FROM generate_series(1, 5)")
    await store.execute("INSERT INTO checkouts (shop, created_at) SELECT 'shop-1', "
                        "now() - interval '3 days' FROM generate_series(1, 7)")
    await store.execute("INSERT INTO checkouts (shop, created_at, completed_at) SELECT "
                        "'shop-1', now() - interval '3 days', now() FROM generate_series(1, 4)")
    policies = store_policies(store_db_url)
    settings = test_settings(db_url, workers=4)
    async with LiveServer(settings, policies, db_url) as live, httpx.AsyncClient(
            base_url=live.base_url, headers={"Authorization": f"Bearer {TOKEN_A}"},
            timeout=10) as client:
        dry = (await client.post("/v1/runs", json={"policy": "expired-carts",
                                                   "dry_run": True})).json()
        dry = await wait_run(client, dry["id"], drained=False)
        assert dry["candidates"] == 60 and dry["released"] == 0
        figures = dry["report"]["policies"]["expired-carts"]
        assert figures["candidates"] == 60 and figures["source"]["pages"] == 2
        assert await store.fetchval("SELECT count(*) FROM carts") == 65  # nothing deleted

        real = (await client.post("/v1/runs", json={})).json()
        real = await wait_run(client, real["id"], drained=True)
        assert real["candidates"] == 67
        assert real["items"] == {"succeeded": 67}
        assert await store.fetchval("SELECT count(*) FROM carts") == 5
        assert await store.fetchval("SELECT count(*) FROM checkouts") == 4

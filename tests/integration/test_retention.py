"""Self-retention: finished history older than the period goes in small batches, with its
attempts; dead, pending and recent items stay; claims are never blocked."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.cluster import retention
from service.observability import metrics
from tests.integration.test_pipeline import make_policies, register

DAY = 86_400


async def prune(engine: AsyncEngine, **kwargs: Any) -> retention.Pruned:
    """Prune items and receipts older than 30 days, keeping no evidence past them."""
    return await retention.prune(engine, keep_seconds=30 * DAY, evidence_keep_seconds=0,
                                 **kwargs)


async def age(engine: AsyncEngine, status: str, days: int, object_ids: list[str]) -> None:
    """Finish items by hand `days` ago, each with one attempt row."""
    dead = "'permanent'" if status == "dead" else "NULL"
    async with engine.begin() as conn:
        await conn.execute(text(
            f"UPDATE items SET status = :status, dead_reason = {dead}, released_at = now(), "
            "completed_at = now() - make_interval(days => :days) "
            "WHERE object_id = ANY(:ids)"), {"status": status, "days": days, "ids": object_ids})
        await conn.execute(text(
            "INSERT INTO attempts (item_id, attempt_no, worker, lease_token, started_at, "
            "finished_at, outcome, http_status, latency_ms) "
            "SELECT id, 1, 'w', gen_random_uuid(), now(), now(), 'succeeded', 204, 1 "
            "FROM items WHERE object_id = ANY(:ids)"), {"ids": object_ids})


async def remaining(engine: AsyncEngine) -> tuple[dict[str, int], int]:
    async with engine.connect() as conn:
        by_status = dict((await conn.execute(text(
            "SELECT status, count(*) FROM items GROUP BY status"))).all())
        attempts = (await conn.execute(text("SELECT count(*) FROM attempts"))).scalar_one()
    return by_status, attempts


async def test_prunes_only_old_finished_items_in_batches(engine: AsyncEngine) -> None:
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 20)
    await age(engine, "succeeded", 40, [f"cart-{i}" for i in range(0, 5)])
    await age(engine, "cancelled", 31, [f"cart-{i}" for i in range(5, 7)])
    await age(engine, "succeeded", 10, [f"cart-{i}" for i in range(7, 10)])
    await age(engine, "dead", 90, [f"cart-{i}" for i in range(10, 12)])
    async with engine.begin() as conn:
        await conn.execute(text(
            "INSERT INTO webhook_receipts (source, webhook_id, result, received_at) VALUES "
            "('shop', 'old', 'ignored', now() - interval '45 days'), "
            "('shop', 'new', 'ignored', now() - interval '1 day')"))
    before = metrics.REGISTRY.get_sample_value("sweeper_retention_pruned_total",
                                               {"table": "items"}) or 0

    pruned = await prune(engine, batch_size=2)

    assert pruned == retention.Pruned(items=7, receipts=1)
    by_status, attempts = await remaining(engine)
    assert by_status == {"succeeded": 3, "dead": 2, "pending": 8}
    assert attempts == 5  # the pruned items' attempts went with them
    assert metrics.REGISTRY.get_sample_value("sweeper_retention_pruned_total",
                                             {"table": "items"}) == before + 7
    async with engine.connect() as conn:
        receipts = (await conn.execute(text("SELECT webhook_id FROM webhook_receipts"))
                    ).scalars().all()
    assert receipts == ["new"]
    # nothing left to do: a second pass deletes nothing
    assert await prune(engine, batch_size=2) == (
        retention.Pruned(0, 0))


async def test_max_batches_bounds_one_pass(engine: AsyncEngine) -> None:
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 10)
    await age(engine, "succeeded", 40, [f"cart-{i}" for i in range(10)])
    first = await prune(engine, batch_size=3, max_batches=2)
    assert first.items == 6
    assert (await prune(engine, batch_size=3)).items == 4


async def test_pruning_never_waits_for_claimed_or_locked_rows(engine: AsyncEngine) -> None:
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 6)
    await age(engine, "succeeded", 40, ["cart-0", "cart-1", "cart-2"])
    async with engine.connect() as holder:
        # another session holds a pending item (as a claim would) and one finished item
        await holder.execute(text("SELECT id FROM items WHERE object_id IN ('cart-3', "
                                  "'cart-0') FOR UPDATE"))
        pruned = await asyncio.wait_for(
            prune(engine, batch_size=10), timeout=5)
        await holder.rollback()
    assert pruned.items == 2  # the locked one is skipped, not waited for
    assert (await prune(engine, batch_size=10)).items == 1


@pytest.mark.parametrize(("table", "index"), [("items", "items_finished"),
                                               ("webhook_receipts", "webhook_receipts_received"),
                                               ("evidence", "evidence_completed")])
async def test_pruning_finds_rows_through_its_index(engine: AsyncEngine, table: str,
                                                    index: str) -> None:
    statement = {"items": retention._PRUNE_ITEMS, "webhook_receipts": retention._PRUNE_RECEIPTS,
                 "evidence": retention._PRUNE_EVIDENCE}
    async with engine.begin() as conn:
        await conn.execute(text("SET LOCAL enable_seqscan = off"))
        plan = "\n".join((await conn.execute(
            text("EXPLAIN " + statement[table].text), {"keep_s": 30 * DAY, "batch": 1000,
                                                        "evidence_keep_s": 365 * DAY}
        )).scalars().all())
    assert index in plan, plan

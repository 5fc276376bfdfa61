"""What operators read stays on its indexes however much finished history the ledger holds:
a page of pending items reads the pending index (`items_listed`), planned with the filters
given (`fetch_filtered`), never a walk of the primary key past every finished row; a run's
progress reads its items' status from the batch index alone."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.db.statements import Statement, fetch, fetch_filtered
from service.ledger import item_selection
from service.runs import progress
from tests.integration.test_pipeline import make_policies, register, release_all

HISTORY = 50_000
_PLAN_MODE = Statement("tests.plan_mode", "The transaction's plan cache mode.",
                       "SELECT current_setting('plan_cache_mode') AS mode")


async def explained(engine: AsyncEngine, statement: Statement, params: dict[str, object]
                    ) -> str:
    async with engine.begin() as conn:
        await conn.execute(text("SET LOCAL plan_cache_mode = force_custom_plan"))
        rows = await conn.execute(text("EXPLAIN " + statement.text), params)
        return "\n".join(r[0] for r in rows)


async def test_pending_pages_read_the_pending_index_despite_history(engine: AsyncEngine
                                                                    ) -> None:
    await register(engine, make_policies("http://127.0.0.1:9"), 20)
    async with engine.begin() as conn:
        await conn.execute(text("""
            INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key,
                               scope, due_at, released_at, status, completed_at)
            SELECT 'acme', 'done-' || g, 'carts', 1, encode(sha256(('d' || g)::bytea), 'hex'),
                   'tenant:acme', now() - interval '3 days', now() - interval '2 days',
                   'succeeded', now() - interval '2 days'
            FROM generate_series(1, :n) g"""), {"n": HISTORY})
        await conn.execute(text("ANALYZE items"))
    for policy in (None, "carts"):
        params = {"status": "pending", "after": None, "limit": 50,
                  **item_selection.filter_params(item_selection.ItemFilter(policy=policy))}
        plan = await explained(engine, item_selection._LIST, params)
        assert "items_listed" in plan and "items_pkey" not in plan, plan
    rows = await item_selection.list_items(engine, status="pending", after=None, limit=50,
                                           item_filter=item_selection.ItemFilter(policy="carts"))
    assert len(rows) == 20


async def test_filtered_statements_are_planned_with_their_values(engine: AsyncEngine) -> None:
    assert (await fetch(engine, _PLAN_MODE, {}))[0].mode == "auto"
    for _ in range(7):  # past the five calls after which a generic plan may be kept
        assert (await fetch_filtered(engine, _PLAN_MODE, {}))[0].mode == "force_custom_plan"
    assert (await fetch(engine, _PLAN_MODE, {}))[0].mode == "auto"  # SET LOCAL: this call only


async def test_run_progress_reads_its_batches_items_from_the_index(engine: AsyncEngine
                                                                   ) -> None:
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 200)
    run_id = await release_all(engine)
    async with engine.begin() as conn:  # many other runs' finished items
        await conn.execute(text("""
            INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key,
                               scope, due_at, released_at, status, completed_at, batch_id)
            SELECT 'acme', 'done-' || g, 'carts', 1, encode(sha256(('d' || g)::bytea), 'hex'),
                   'tenant:acme', now() - interval '3 days', now() - interval '2 days',
                   'succeeded', now() - interval '2 days', 1000000 + g / 500
            FROM generate_series(1, :n) g"""), {"n": HISTORY})
    async with engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text("VACUUM ANALYZE items"))
    plan = await explained(engine, progress._PROGRESS, {"ids": [run_id]})
    assert "Index Only Scan using items_batch_cover" in plan, plan
    assert "Seq Scan on items" not in plan, plan

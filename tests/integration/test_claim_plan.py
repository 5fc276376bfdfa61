"""The admission statement's plan stays on the claimable-row indexes however much finished
history the ledger holds: the claim path must never scan succeeded or dead rows."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.budget import buckets, rules, scope_controls
from service.ledger import claims, holds
from service.ledger import registration as ledger
from service.runs import publication
from tests.integration.test_pipeline import make_policies, register, release_all

HISTORY = 50_000


async def add_history(engine: AsyncEngine) -> None:
    """A long finished history in tenant:acme's scope, as a busy ledger accumulates, and
    the statistics of the ledger with it."""
    async with engine.begin() as conn:
        await conn.execute(text("""
            INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key,
                               scope, due_at, released_at, status, completed_at, dead_reason)
            SELECT 'acme', 'done-' || g, 'carts', 1, encode(sha256(('d' || g)::bytea), 'hex'),
                   'tenant:acme', now() - interval '3 days', now() - interval '2 days',
                   CASE WHEN g % 10 = 0 THEN 'dead' ELSE 'succeeded' END,
                   now() - interval '2 days',
                   CASE WHEN g % 10 = 0 THEN 'permanent' END
            FROM generate_series(1, :n) g"""), {"n": HISTORY})
        await conn.execute(text("ANALYZE items"))


def admission_params(names: list[str]) -> dict[str, object]:
    """The worker's admission of 8 items from each scope named, as claims.admit binds it."""
    return {"names": names, "wants": [8] * len(names), "owner": "plan",
            "lookahead": rules.LOOKAHEAD_S, "policy_names": ["carts"],
            "lease_seconds": [30], "default_lease": 60,
            "limit_policies": ["carts"], "limit_attempts": [3]}


async def plan_of_admission(engine: AsyncEngine, names: list[str]) -> str:
    """EXPLAIN (no ANALYZE: nothing runs) of the worker's admission statement."""
    params = admission_params(names)
    async with engine.connect() as conn:
        rows = await conn.execute(text("EXPLAIN " + str(claims._ADMIT.text)), params)
        return "\n".join(r[0] for r in rows)


async def test_admission_uses_the_claimable_indexes_despite_history(engine: AsyncEngine
                                                                   ) -> None:
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 20)
    await release_all(engine)
    await add_history(engine)

    plan = await plan_of_admission(engine, ["tenant:acme"])

    assert "items_ready" in plan, plan
    # the claim position bounds the scan (an index condition, not a filter): a claim never
    # walks the entries that earlier claims left at the index's front
    assert ("ROW(COALESCE(batch_id, '0'::bigint), id) > ROW(" in
            next(line for line in plan.splitlines() if "Index Cond" in line
                 and "batch_id" in line)), plan
    assert "Seq Scan on items" not in plan, plan

    # the probe for scopes with work looks after the claim position first, on the index too
    async with engine.connect() as conn:
        rows = await conn.execute(text("EXPLAIN " + str(buckets._ELIGIBLE.text)),
                                  {"cursor": "", "limit": 10})
        probe = "\n".join(r[0] for r in rows)
    assert ("ROW(COALESCE(batch_id, '0'::bigint), id) > ROW(s.ready_after_batch, "
            "s.ready_after_id)" in probe), probe
    assert "Seq Scan on items" not in probe, probe


async def test_only_operators_reads_can_use_the_listed_pending_index(engine: AsyncEngine
                                                                     ) -> None:
    # Each statement on pending items that is not an operator's read, planned with its own
    # index gone (dropped inside a transaction that is rolled back), must still not take
    # the operators' index of pending items: stale statistics (a backlog released after the
    # last analyze) once made it the planner's choice for the claim, which then sorted the
    # scope's whole backlog on every claim. The planner's choice is a near-tie on a small
    # table; taking the intended index away shows what it could fall back on.
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 20)
    await release_all(engine)
    await register(engine, policies, 5, tenant="globex")  # unreleased: the pick's candidates
    await add_history(engine)
    statements = [
        ("items_ready", str(claims._ADMIT.text), admission_params(["tenant:acme"])),
        ("items_ready", buckets._ELIGIBLE.text, {"cursor": "", "limit": 10}),
        ("items_ready", scope_controls._WAITING.text, {"reason": "store-unreachable", "after": "",
                                                       "tenant": None, "limit": 100}),
        ("items_unreleased", publication._PICK.text, {"cutoff": datetime.now(UTC), "policy": None,
                                                      "tenant": None, "limit": 500}),
    ]
    for own_index, statement, params in statements:
        async with engine.connect() as conn:
            async with conn.begin() as tx:
                intended = "\n".join(r[0] for r in await conn.execute(
                    text("EXPLAIN " + statement), params))
                await conn.execute(text(f"DROP INDEX {own_index}"))
                fallback = "\n".join(r[0] for r in await conn.execute(
                    text("EXPLAIN " + statement), params))
                await tx.rollback()
        assert own_index in intended, intended
        assert "items_listed" not in fallback, fallback


async def test_publication_picks_without_sorting_even_before_any_analyze(
        engine: AsyncEngine) -> None:
    # A backlog registered in bulk is picked before autovacuum has analyzed it: with no
    # statistics the planner believes one row matches. The pick must still be an ordered
    # index scan that stops after :limit rows, never a sort of every due row.
    async with engine.begin() as conn:
        # autovacuum would analyze the fresh rows at a moment of its choosing (it once did
        # mid-test on a loaded machine): this test is about the plan before any analyze
        await conn.execute(text("ALTER TABLE items SET (autovacuum_enabled = false)"))
        # nor may statistics an earlier test's analyze left in this reused database (the
        # fixture's TRUNCATE keeps them) inform the plan: dropped (the tests are superuser)
        await conn.execute(text("DELETE FROM pg_statistic WHERE starelid = 'items'::regclass"))
        # and no row count: a VACUUM (autovacuum's or a test's) of this reused database's
        # emptied table leaves reltuples 0, "known empty", where never vacuumed is -1
        await conn.execute(text("UPDATE pg_class SET reltuples = -1, relpages = 0 "
                                "WHERE oid = 'items'::regclass"))
        await conn.execute(text("""
            INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key,
                               scope, due_at)
            SELECT 'acme', 'c-' || g, 'carts', 1, encode(sha256(('c' || g)::bytea), 'hex'),
                   'tenant:acme', now() - interval '1 day' + (g % 600) * interval '1 second'
            FROM generate_series(1, 20000) g"""))
        # what the planner knows of the table: no column statistics, no row count
        known = (await conn.execute(text(
            "SELECT (SELECT count(*) FROM pg_stats WHERE tablename = 'items'), "
            "(SELECT reltuples FROM pg_class WHERE oid = 'items'::regclass)"))).one()
        assert known[0] == 0 and known[1] < 0, known
        rows = await conn.execute(text("EXPLAIN " + str(publication._PICK.text)), {
            "cutoff": datetime.now(UTC), "policy": None, "tenant": None, "limit": 500})
        plan = "\n".join(r[0] for r in rows)
        await conn.execute(text("ALTER TABLE items RESET (autovacuum_enabled)"))
    assert "items_unreleased" in plan, plan
    assert "Sort" not in plan, plan


async def test_hold_checks_probe_one_index_whatever_the_number_of_holds(
        engine: AsyncEngine) -> None:
    """Many object-id holds on one tenant: registration's marking and the admission each
    find an item's holds through `hold_objects`' key and `holds_whole`, never by walking
    the tenant's holds and their arrays (migration 0020)."""
    policies = make_policies("http://127.0.0.1:9")
    for n in range(40):
        await holds.place(engine, holds.HoldSpec(
            tenant_id="acme", object_ids=[f"held-{n}-{i}" for i in range(1000)],
            reason="plan", reference=f"CASE-{n}"), actor="test")
    await register(engine, policies, 20)
    await release_all(engine)
    async with engine.begin() as conn:
        await conn.execute(text("ANALYZE"))
        registration = "\n".join(r[0] for r in await conn.execute(text(
            "EXPLAIN " + str(ledger._REGISTER.text)), {
                "tenants": "acme", "objects": "cart-new", "policies": "carts",
                "versions": [1], "keys": "k" * 64, "scopes": "tenant:acme",
                "dues": "2026-01-01T00:00:00Z", "regions": ""}))
    admission = await plan_of_admission(engine, ["tenant:acme"])
    for plan in (registration, admission):
        assert "hold_objects_pkey" in plan, plan
        assert "Seq Scan on hold_objects" not in plan, plan


@pytest.mark.parametrize("cache_mode", ["force_generic_plan", "force_custom_plan"])
@pytest.mark.parametrize("region", [None, "eu"])
async def test_an_admission_plan_stops_at_its_limit_in_a_large_scope(
        engine: AsyncEngine, cache_mode: str, region: str | None) -> None:
    """The worker's admission runs as a prepared statement, whose plan turns generic after
    five runs: its hold checks must stay filters on the rows it reads in index order, never
    joins that sort a scope's whole backlog (a 200,000-item scope took 300 ms a claim). So
    must its region's (a worker of no region's too, whose NULL the planner once took to
    match no row), in a ledger where half the items are another region's."""
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 5)
    await release_all(engine)
    other = "us" if region is not None else "eu"
    async with engine.begin() as conn:
        await conn.execute(text("""
            INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key,
                               scope, due_at, released_at, region)
            SELECT t, 'r-' || g, 'carts', 1, encode(sha256((t || g)::bytea), 'hex'),
                   'tenant:' || t, now() - interval '1 day', now(),
                   CASE WHEN t = 'acme' THEN CAST(:mine AS text) ELSE :other END
            FROM generate_series(1, 20000) g, unnest(ARRAY['acme', 'globex']) t"""),
            {"mine": region, "other": other})
        await conn.execute(text("ANALYZE"))
    statement, params = ((claims._ADMIT, admission_params(["tenant:acme"]))
                         if region is None else
                         (claims._ADMIT_IN_REGION,
                          {**admission_params(["tenant:acme"]), "region": region}))
    async with engine.connect() as conn:
        await conn.execute(text(f"SET plan_cache_mode = {cache_mode}"))
        rows = await conn.execute(text("EXPLAIN " + str(statement.text)), params)
        plan = "\n".join(r[0] for r in rows)
        await conn.rollback()
    assert "Anti Join" not in plan, plan
    assert "items_ready" in plan and "Bitmap Heap Scan on items" not in plan, plan

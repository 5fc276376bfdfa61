"""The tests' clock (tests/integration/db_clock.py) moves every instant the service compares
with the database's clock, and only for the scopes it is asked to."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.integration.db_clock import CLOCK_COLUMNS, OTHER_TIME_COLUMNS, advance


async def test_every_timestamp_column_is_moved_or_known_not_to_be_clock_relative(
        engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT table_name, column_name FROM information_schema.columns "
            "WHERE table_schema = 'public' AND table_name IN ('scopes', 'items') "
            "AND data_type = 'timestamp with time zone'"))).all()
    found = {(t, c) for t, c in rows}
    known = {(t, c) for table in (CLOCK_COLUMNS, OTHER_TIME_COLUMNS)
             for t, columns in table.items() for c in columns}
    assert found == known


async def test_advance_moves_the_named_scopes_and_their_items_only(engine: AsyncEngine
                                                                   ) -> None:
    async with engine.begin() as conn:
        await conn.execute(text(
            "INSERT INTO scopes (name, rate_per_second, burst, tokens, closed_until, "
            "front_scanned_at) VALUES ('moved', 1, 1, 1, now(), now()), "
            "('still', 1, 1, 1, now(), now())"))
        await conn.execute(text("""
            INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key,
                               scope, due_at, next_attempt_at, released_at, status,
                               lease_owner, lease_token, lease_expires_at)
            SELECT 't', s, 'p', 1, encode(sha256(convert_to(s, 'UTF8')), 'hex'), s, now(),
                   now(), now(), 'pending',
                   'w', gen_random_uuid(), now()
            FROM unnest(ARRAY['moved', 'still']) s"""))
    query = text(
        "SELECT s.name, s.refilled_at, s.closed_until, s.front_scanned_at, "
        "i.next_attempt_at, i.lease_expires_at, s.created_at, i.due_at "
        "FROM scopes s JOIN items i ON i.scope = s.name ORDER BY s.name")
    async with engine.connect() as conn:
        before = {r[0]: r[1:] for r in (await conn.execute(query)).all()}

    await advance(engine, 2.5, scopes=["moved"])

    async with engine.connect() as conn:
        after = {r[0]: r[1:] for r in (await conn.execute(query)).all()}
    assert after["still"] == before["still"]
    shift = timedelta(seconds=2.5)
    # the five clock-relative instants moved back; the records (created_at, due_at) did not
    assert after["moved"][:5] == tuple(t - shift for t in before["moved"][:5])
    assert after["moved"][5:] == before["moved"][5:]

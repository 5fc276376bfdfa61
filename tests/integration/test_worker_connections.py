"""The worker's held connections (service/worker/postgres.py): admissions and completions
go to asyncpg itself on connections the pool keeps, so a connection whose server process
went away must be dropped, not given back to the pool as if it were sound, and the next
statement must run on a fresh one."""

from __future__ import annotations

import logging

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.db.engine import UNAVAILABLE_ERRORS
from service.ledger.claims import Lease
from service.ledger.completions import Completion
from service.observability.failures import expected
from service.worker.postgres import PostgresLedger
from tests.conftest import eventually
from tests.integration.test_pipeline import PAST, SCOPE, make_policies, register, release_all


async def backends(engine: AsyncEngine) -> list[int]:
    """The server processes of this database other than the asking one."""
    async with engine.connect() as conn:
        rows = await conn.execute(text(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()"))
        return [r.pid for r in rows]


async def terminate(engine: AsyncEngine, pids: list[int]) -> None:
    """End those server processes (a failover, an operator's kill) and wait until they are
    gone."""
    async with engine.connect() as conn:
        await conn.execute(text("SELECT pg_terminate_backend(pid) FROM unnest(CAST(:p AS "
                                "integer[])) AS pid"), {"p": pids})

    async def gone() -> bool:
        return not set(pids) & set(await backends(engine))
    await eventually(gone, "the terminated backends to exit")


def done(lease: Lease) -> Completion:
    return Completion(lease=lease, worker="held", outcome="succeeded", status="succeeded",
                      reason="ok", http_status=200, retry_after_seconds=None,
                      retry_in_seconds=0.0, refund_attempt=False,
                      started_at=lease.lease_expires_at, finished_at=lease.lease_expires_at,
                      latency_ms=1.0)


async def test_a_held_connection_whose_backend_ended_is_dropped_and_replaced(
        engine: AsyncEngine, caplog: pytest.LogCaptureFixture) -> None:
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 3, due=PAST)
    await release_all(engine)
    await engine.dispose()  # only the ledger's connections from here on
    ledger = PostgresLedger(engine, policies, owner="held")
    caplog.set_level(logging.ERROR, logger="sqlalchemy.pool")
    async with ledger.hold():
        first = await ledger.admit({SCOPE: 1})
        assert len(first.leases) == 1
        await ledger.complete([done(first.leases[0])])
        # both held connections' server processes end (a failover, an operator's kill)
        await terminate(engine, await backends(engine))
        # each held connection fails once, as an outage, and is replaced
        with pytest.raises(UNAVAILABLE_ERRORS) as failed:
            await ledger.admit({SCOPE: 1})
        assert expected(failed.value), repr(failed.value)
        again = await ledger.admit({SCOPE: 1})
        assert len(again.leases) == 1
        lease = again.leases[0]
        with pytest.raises(UNAVAILABLE_ERRORS) as failed:
            await ledger.complete([done(lease)])
        assert expected(failed.value), repr(failed.value)
        assert await ledger.complete([done(lease)]) == []
    async with engine.connect() as conn:
        status = (await conn.execute(text("SELECT status FROM items WHERE id = :i"),
                                     {"i": lease.item_id})).scalar_one()
    assert status == "succeeded"
    # the dead connection was discarded, not reset and pooled
    assert not [r for r in caplog.records if r.name.startswith("sqlalchemy.pool")]


async def test_ledger_sessions_run_without_jit_and_with_their_timeouts(engine: AsyncEngine
                                                                        ) -> None:
    """Every statement on the ledger is short: JIT compiling the gauges' reading cost ten
    times its execution (bench/reports/2026-12-05-console-charts)."""
    async with engine.connect() as conn:
        settings = {name: (await conn.execute(text(f"SHOW {name}"))).scalar_one()
                    for name in ("jit", "idle_in_transaction_session_timeout",
                                 "application_name")}
    assert settings == {"jit": "off", "idle_in_transaction_session_timeout": "1min",
                        "application_name": "sweeper"}

"""`sweeper worker` as a real OS process: it drains, stops cleanly on SIGTERM, and a worker
killed after the upstream accepted but before its commit leads to exactly one more call
with the same operation key."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import httpx
import pytest

from service import ledger, runs
from service.db.engine import make_engine
from service.settings import async_url
from tests.conftest import free_port, test_settings
from tests.fakes.upstream import FakeUpstream
from tests.integration.test_pipeline import make_policies

POLICIES = """
[upstreams.shop]
base_url = "{base_url}"
timeout_seconds = 2

[policies.carts]
version = 1
upstream = "shop"
path = "/carts/{{object_id}}"
scope = "tenant:{{tenant_id}}"
rate = {{ per_second = {rate}, burst = {burst} }}
lease_seconds = {lease}
max_attempts = 5
"""


def write_policies(folder: Path, base_url: str, *, rate: float = 1000, burst: int = 1000,
                   lease: int = 5) -> Path:
    """A policies file for `sweeper worker` processes: one policy against `base_url`."""
    path = folder / "policies.toml"
    path.write_text(POLICIES.format(base_url=base_url, rate=rate, burst=burst, lease=lease))
    return path


def start_worker(db_url: str, policies_file: Path, *, workers: int = 2, metrics_port: int = 0
                 ) -> subprocess.Popen[bytes]:
    """`sweeper worker` as a separate OS process on the test database."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
    env.update({"SWEEPER_DATABASE_URL": db_url, "SWEEPER_POLICIES_FILE": str(policies_file),
                "SWEEPER_WORKERS": str(workers), "SWEEPER_LOG_FORMAT": "json",
                "SWEEPER_LOG_LEVEL": "WARNING", "SWEEPER_METRICS_PORT": str(metrics_port)})
    return subprocess.Popen([sys.executable, "-m", "service", "worker"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def seed(db_url: str, base_url: str, n: int) -> None:
    policies = make_policies(base_url)
    engine = make_engine(async_url(db_url), test_settings(db_url))
    try:
        pol = policies.policies["carts"]
        await ledger.register(engine, [ledger.Registration(
            "acme", f"c{i}", pol, datetime(2026, 1, 1, tzinfo=UTC)) for i in range(n)])
        run_id, _ = await runs.create_run(
            engine, runs.RunRequest(None, None, None, False, None), None)
        await runs.publish(engine, run_id, batch_size=100)
    finally:
        await engine.dispose()


async def wait_for(predicate, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


async def count_status(db_url: str, status: str) -> int:
    conn = await asyncpg.connect(db_url)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM items WHERE status = $1", status))
    finally:
        await conn.close()


@pytest.mark.slow
async def test_worker_process_drains_and_stops_on_sigterm(db_url: str, tmp_path: Path) -> None:
    port = free_port()
    async with FakeUpstream() as upstream:
        policies_file = write_policies(tmp_path, upstream.base_url)
        await seed(db_url, upstream.base_url, 50)
        proc = start_worker(db_url, policies_file, metrics_port=port)
        try:
            async def all_done() -> bool:
                return await count_status(db_url, "succeeded") == 50

            await wait_for(all_done)
            # the worker process serves its own counters for Prometheus
            async with httpx.AsyncClient() as client:
                scraped = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
            assert 'sweeper_build_info{version="' in scraped
        finally:
            proc.send_signal(signal.SIGTERM)
            _, stderr = proc.communicate(timeout=20)
        assert proc.returncode == 0, stderr.decode()
        assert len(upstream.calls()) == 50


@pytest.mark.slow
async def test_sigkill_after_upstream_accepted_before_commit(db_url: str, tmp_path: Path
                                                             ) -> None:
    async with FakeUpstream() as upstream:
        policies_file = write_policies(tmp_path, upstream.base_url)
        await seed(db_url, upstream.base_url, 1)
        # Hold a lock that the completion's INSERT INTO attempts must wait for (claims never
        # touch that table): the worker gets its 204 but cannot commit it.
        blocker = await asyncpg.connect(db_url)
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute("LOCK TABLE attempts IN SHARE MODE")
        first = start_worker(db_url, policies_file)
        try:
            async def called() -> bool:
                return len(upstream.calls()) == 1

            await wait_for(called)
            await asyncio.sleep(0.3)  # the 204 is in; the commit is waiting on our lock
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=10)
        finally:
            await tx.rollback()
            await blocker.close()
        assert await count_status(db_url, "leased") == 1  # nothing was committed

        second = start_worker(db_url, policies_file)
        try:
            async def succeeded() -> bool:
                return await count_status(db_url, "succeeded") == 1

            await wait_for(succeeded, timeout=30)  # after the 5 s lease runs out
        finally:
            second.send_signal(signal.SIGTERM)
            second.communicate(timeout=20)
        calls = upstream.calls()
        assert len(calls) == 2
        assert calls[0].idempotency_key == calls[1].idempotency_key
        conn = await asyncpg.connect(db_url)
        try:
            row = await conn.fetchrow("SELECT attempts, status FROM items")
            attempts = await conn.fetch("SELECT outcome, fenced FROM attempts")
        finally:
            await conn.close()
        assert tuple(row) == (2, "succeeded")
        assert [tuple(a) for a in attempts] == [("succeeded", False)]

"""`sweeper run --follow` against a live server, and `sweeper demo` end to end."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service import follow
from tests.conftest import TOKEN_A, LiveServer, test_settings
from tests.fakes.upstream import FakeUpstream
from tests.integration.test_pipeline import make_policies

# every test here starts processes (see the marker in pyproject.toml)
pytestmark = pytest.mark.slow


async def test_trigger_and_follow_until_drained(db_url: str) -> None:
    async with FakeUpstream() as upstream:
        policies = make_policies(upstream.base_url)
        async with LiveServer(test_settings(db_url, workers=4), policies, db_url) as live:
            async with httpx.AsyncClient(base_url=live.base_url, headers={
                    "Authorization": f"Bearer {TOKEN_A}"}) as api:
                items = [{"tenant_id": "t", "object_id": f"o{i}", "policy": "carts",
                          "due_at": "2026-01-01T00:00:00Z"} for i in range(40)]
                assert (await api.post("/v1/items", json={"items": items})).status_code == 200
                run = await follow.trigger(api, {"policy": "carts"}, "slot-42")
                out = io.StringIO()
                final = await follow.follow(api, int(run["id"]), out=out, timeout_s=30)
            assert final["items"] == {"succeeded": 40}
            assert "40/40 100%" in out.getvalue()
            with pytest.raises(follow.RunFailed, match="HTTP 401"):
                async with httpx.AsyncClient(base_url=live.base_url) as anon:
                    await follow.trigger(anon, {}, None)


def test_run_command_without_a_server_is_one_clear_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
    env["SWEEPER_TOKEN"] = "x" * 20
    result = subprocess.run([sys.executable, "-m", "service", "run", "--url",
                             "http://127.0.0.1:1", "--follow"], env=env, capture_output=True,
                            text=True, timeout=30, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "cannot reach" in result.stderr


def test_demo_drains_everything(tmp_path: object) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
    result = subprocess.run([sys.executable, "-m", "service", "demo", "--items", "100",
                             "--tenants", "3"], env=env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "done: succeeded=100" in result.stdout
    assert "Traceback" not in result.stderr


async def test_following_a_failed_run_stops_with_its_error(api: httpx.AsyncClient,
                                                           engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        run_id = (await conn.execute(text(
            "INSERT INTO runs (request_digest, cutoff, dry_run, state, error, report) "
            "VALUES ('d', now(), false, 'failed', 'database-error', jsonb_build_object("
            "'error', jsonb_build_object('code', 'database-error', 'message', "
            "'UniqueViolationError (SQLSTATE 23505)'))) RETURNING id"))).scalar_one()
    with pytest.raises(follow.RunFailed, match="failed: database-error: UniqueViolationError"):
        await follow.follow(api, run_id, out=io.StringIO(), timeout_s=10)

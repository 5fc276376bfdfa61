"""`sweeper run --follow` against a live server, and `sweeper demo` end to end."""

from __future__ import annotations

import asyncio
import io
import os
import re
import signal
import subprocess
import sys
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.commands import run_client
from service.commands.exits import Exit
from service.protocols.egress import public_roots
from tests.conftest import TOKEN_A, LiveServer, test_settings
from tests.fakes.upstream import FakeUpstream, Fault
from tests.integration.test_pipeline import make_policies

# every test here starts processes (see the marker in pyproject.toml)
pytestmark = pytest.mark.slow


async def test_trigger_and_follow_until_drained(db_url: str) -> None:
    async with FakeUpstream() as upstream:
        policies = make_policies(upstream.base_url)
        async with LiveServer(test_settings(db_url, workers=4), policies, db_url) as live:
            async with httpx.AsyncClient(verify=public_roots(), base_url=live.base_url, headers={
                    "Authorization": f"Bearer {TOKEN_A}"}) as api:
                items = [{"tenant_id": "t", "object_id": f"o{i}", "policy": "carts",
                          "due_at": "2026-01-01T00:00:00Z"} for i in range(40)]
                assert (await api.post("/v1/items", json={"items": items})).status_code == 200
                run = await run_client.trigger(api, {"policy": "carts"}, "slot-42")
                out = io.StringIO()
                async with asyncio.timeout(30):
                    final = await run_client.follow(api, int(run["id"]), out=out)
            assert final["items"] == {"succeeded": 40}
            assert "40/40 100%" in out.getvalue()
            with pytest.raises(run_client.RunFailed, match="HTTP 401"):
                async with httpx.AsyncClient(verify=public_roots(), base_url=live.base_url) as anon:
                    await run_client.trigger(anon, {}, None)


async def test_ctrl_c_on_follow_says_the_run_goes_on(db_url: str) -> None:
    """Ctrl-C on `sweeper run --follow` exited 130 saying nothing, as if the run had been
    stopped: it stops only the following, and says so, with the run, where to see it and
    (with a trigger key) that the same command follows it again. (No workers here: the
    run never drains.)"""
    policies = make_policies("http://127.0.0.1:9")
    async with LiveServer(test_settings(db_url, workers=0), policies, db_url) as live:
        async with httpx.AsyncClient(verify=public_roots(), base_url=live.base_url, headers={
                "Authorization": f"Bearer {TOKEN_A}"}) as api:
            items = [{"tenant_id": "t", "object_id": "o1", "policy": "carts",
                      "due_at": "2026-01-01T00:00:00Z"}]
            assert (await api.post("/v1/items", json={"items": items})).status_code == 200
            env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
            env["SWEEPER_TOKEN"] = TOKEN_A
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "service", "run", "--url", live.base_url, "--follow",
                "--idempotency-key", "slot-7", env=env, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE)
            assert proc.stdout is not None and proc.stderr is not None
            announced = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
            assert announced.startswith(b"run 1: cutoff "), announced
            proc.send_signal(signal.SIGINT)
            _, err = await asyncio.wait_for(proc.communicate(), timeout=30)
            assert proc.returncode == Exit.INTERRUPTED, err
            assert err.decode().splitlines()[-1] == (
                f"sweeper: interrupted: run 1 goes on on the server; GET {live.base_url}"
                "/v1/runs/1 shows its progress; the same command follows it again "
                "(Idempotency-Key 'slot-7': the same run)")
            run = (await api.get("/v1/runs/1")).json()  # untouched: going on
            assert run["state"] in ("publishing", "published") and "cancelled" not in run[
                "items"], run


def test_run_command_without_a_server_is_one_clear_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
    env["SWEEPER_TOKEN"] = "x" * 20
    result = subprocess.run([sys.executable, "-m", "service", "run", "--url",
                             "http://127.0.0.1:1", "--follow"], env=env, capture_output=True,
                            text=True, timeout=30, check=False)
    assert result.returncode == Exit.SERVER
    assert result.stderr.strip().count("\n") == 0 and "cannot reach" in result.stderr


def test_demo_drains_everything(tmp_path: object) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
    result = subprocess.run([sys.executable, "-m", "service", "demo", "--items", "100",
                             "--tenants", "3"], env=env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "done: succeeded=100" in result.stdout
    # its embedded database signs evidence as the documentation says (it warned that its
    # exports were unsigned)
    assert "unsigned" not in result.stderr, result.stderr
    # the report-only run's figures, as announced
    assert re.search(r"report-only run 1 first .*: 100 candidates, the oldest due 20",
                     result.stdout)
    assert "Traceback" not in result.stderr


async def test_following_a_failed_run_stops_with_its_error(api: httpx.AsyncClient,
                                                           engine: AsyncEngine) -> None:
    """follow() returns a failed run at once; `sweeper run --follow` exits 6 with its
    error."""
    async with engine.begin() as conn:
        run_id = (await conn.execute(text(
            "INSERT INTO runs (request_digest, cutoff, dry_run, state, error, report) "
            "VALUES ('d', now(), false, 'failed', 'database-error', jsonb_build_object("
            "'error', jsonb_build_object('code', 'database-error', 'message', "
            "'UniqueViolationError (SQLSTATE 23505)'))) RETURNING id"))).scalar_one()
    async with asyncio.timeout(10):
        final = await run_client.follow(api, run_id, out=io.StringIO())
    code, line = run_client.outcome(final)
    assert code == Exit.RUN_FAILED
    assert line == f"run {run_id} failed: database-error: UniqueViolationError (SQLSTATE 23505)"


async def test_run_follow_exit_codes(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`sweeper run --follow` (its command body, against a live server): 0 when nothing was
    due, saying so; 1 when items went dead; 0 when everything succeeded."""
    async with FakeUpstream() as upstream:
        policies = make_policies(upstream.base_url, max_attempts=1)
        async with LiveServer(test_settings(db_url, workers=4), policies, db_url) as live:
            def command(**body: object) -> Any:
                return run_client.run_command(live.base_url, TOKEN_A, dict(body), None, True)

            assert await command(policy="carts") == Exit.OK
            assert "nothing was due by the cutoff" in capsys.readouterr().out

            async with httpx.AsyncClient(verify=public_roots(), base_url=live.base_url, headers={
                    "Authorization": f"Bearer {TOKEN_A}"}) as api:
                items = [{"tenant_id": "t", "object_id": f"o{i}", "policy": "carts",
                          "due_at": "2026-01-01T00:00:00Z"} for i in range(4)]
                assert (await api.post("/v1/items", json={"items": items})).status_code == 200
            upstream.inject(Fault.STATUS, times=2, status=400)  # permanent: dead at once
            assert await command(policy="carts") == Exit.INCOMPLETE
            err = capsys.readouterr().err
            assert "dead=2" in err and "succeeded=2" in err and "2 item(s) went dead" in err

            assert await command(policy="carts", dry_run=True) == Exit.OK
            assert "0 candidate(s)" in capsys.readouterr().out


def test_outcome_of_a_drained_run() -> None:
    run = {"id": 7, "state": "published", "dry_run": False, "released": 3,
           "items": {"succeeded": 2, "cancelled": 1}, "cutoff": "2026-01-01T00:00:00Z"}
    assert run_client.outcome(run) == (Exit.OK, "run 7 drained: cancelled=1, succeeded=2")

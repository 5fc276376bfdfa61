"""`sweeper drill` as an operator runs it: the list, a verdict as JSON, the exit codes, and
no scratch database left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import asyncpg
import pytest

from drills.catalog import DRILLS
from service.commands.exits import Exit

# every test here starts processes (see the marker in pyproject.toml)
pytestmark = pytest.mark.slow


def sweeper(*args: str, database_url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
    if database_url is not None:
        env["SWEEPER_DATABASE_URL"] = database_url
    return subprocess.run([sys.executable, "-m", "service", "drill", *args], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_list_describes_every_drill() -> None:
    out = sweeper("--list")
    assert out.returncode == 0, out.stderr
    for drill in DRILLS:
        assert f"{drill.number:>2} {drill.name}" in out.stdout
    assert out.stdout.count("assertion:") == len(DRILLS)


def test_unknown_drill_is_a_usage_error() -> None:
    out = sweeper("no-such-drill", database_url="postgresql://postgres@127.0.0.1:1/x")
    assert out.returncode == Exit.USAGE  # told before the (unreachable) database is tried
    assert "no-such-drill" in out.stderr


async def test_a_drill_runs_in_a_scratch_database_and_reports_json(pg_server_url: str
                                                                    ) -> None:
    out = sweeper("concurrent-cron-triggers", "--json", database_url=pg_server_url)
    assert out.returncode == 0, out.stdout + out.stderr
    [verdict] = json.loads(out.stdout)
    assert verdict["drill"] == "concurrent-cron-triggers" and verdict["status"] == "pass"
    assert verdict["facts"]["runs"] == 1
    conn = await asyncpg.connect(pg_server_url)
    try:
        left = await conn.fetchval(
            "SELECT count(*) FROM pg_database WHERE datname LIKE 'sweeper_drill_%'")
    finally:
        await conn.close()
    assert left == 0

"""The benchmark harness end to end in a tiny configuration: `python -m bench drain` as a
subprocess against the test server, both upstream modes, one repetition, with the profile
and EXPLAIN sections; it must write the JSON document and drain every item."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import REPO_ROOT

ITEMS = 200
CONCURRENCY = 8


def run_bench(pg_server_url: str, out: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "drain", "--items", str(ITEMS), "--repeat", "1",
         "--concurrency", str(CONCURRENCY), "--side-items", str(ITEMS), "--no-log-compare",
         "--database-url", pg_server_url, "--json-out", str(out)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=90, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return doc


def test_drain_benchmark_smoke(pg_server_url: str, tmp_path: Path) -> None:
    doc = run_bench(pg_server_url, tmp_path / "bench.json")

    machine = doc["machine"]
    assert machine["cpu_count"] >= 1
    assert machine["python"]["version"]
    assert machine["postgresql"]["version"]
    assert {"sqlalchemy", "asyncpg", "httpx"} <= set(machine["packages"])
    assert all(machine["packages"][p] for p in ("sqlalchemy", "asyncpg", "httpx"))

    drain = doc["benchmarks"]["drain"]
    params = drain["parameters"]
    assert params["items"] == {"mock": ITEMS, "loopback": ITEMS}
    assert params["concurrency"] == [CONCURRENCY] and params["repeat"] == 1
    for mode in ("mock", "loopback"):
        cell = drain["results"][mode][str(CONCURRENCY)]
        assert cell["items_per_s"]["median"] > 0
        [rep] = cell["repetitions"]
        assert rep["all_succeeded"] is True
        assert rep["db_status"] == {"succeeded": ITEMS}
        assert rep["attempt_rows"] == ITEMS and rep["upstream_calls"] == ITEMS
        assert rep["completed"] == ITEMS and rep["fenced"] == 0
        assert rep["claim"]["rows"] == ITEMS and rep["complete"]["rows"] == ITEMS

    assert drain["focus_concurrency"] == CONCURRENCY
    assert set(drain["target"]) >= {"items_per_s", "best_median_items_per_s", "met"}

    profile = drain["profile"]
    assert profile["run"]["items"] == ITEMS
    assert {"claim_statement", "complete_statement", "upstream_call_httpx",
            "logging_info"} <= set(profile["anchors_cumulative"])
    assert profile["top_cumulative"] and profile["top_self"]

    explain = drain["explain"]
    for key in ("claim_at_start", "claim_half_drained"):
        for plan in ("custom", "generic"):
            assert any("Update on items" in line for line in explain[key][plan])
    assert any("Insert on attempts" in line for line in explain["complete_half_drained"])

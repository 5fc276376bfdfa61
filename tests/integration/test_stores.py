"""The store's own database as source and target, end to end: discovery by the production
predicate, report-only first, deletion in bounded batches that re-check the cutoff, and the
next run collecting what a paused schedule left behind (docs/stores.md, the worked example)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from service.budget import scope_controls
from service.budget.credential_waits import Credentials
from service.cluster import retention
from service.config.policies import Policies
from service.config.policy_file import GuardConfig
from service.ledger import claims
from service.observability import metrics
from service.outcomes import Failure, Outcome, classify
from service.runs import discovery, publication, trigger
from service.runs.discovery import Discovery
from service.sweeps.store_databases import SourceRows, StoreError, Stores
from service.sweeps.store_targets import StoreTargets, ledger_tables
from service.upstreams.deletion_api import Upstreams
from service.worker import database_pool, scope_resumption
from tests.conftest import LiveServer, free_port, test_settings
from tests.fakes.store_schema import (
    CARTS_SOURCE,
    CARTS_TARGET,
    create_store,
    store_policies,
)
from tests.integration.test_cli import sweeper
from tests.integration.test_pipeline import drain


@pytest.fixture
async def store(store_db_url: str) -> AsyncIterator[asyncpg.Connection]:
    await create_store(store_db_url)
    conn = await asyncpg.connect(store_db_url)
    yield conn
    await conn.close()


async def wait_run(client: httpx.AsyncClient, run_id: int, *, drained: bool,
                   timeout_s: float = 20) -> dict[str, Any]:
    async with asyncio.timeout(timeout_s):
        while True:
            run = (await client.get(f"/v1/runs/{run_id}")).json()
            unfinished = sum(run["items"].get(s, 0) for s in ("pending", "leased", "held"))
            if run["state"] != "publishing" and (not drained or not unfinished):
                return run
            await asyncio.sleep(0.05)


DISCOVERED = 'sweeper_discovered_rows_total{policy="expired-carts",result="candidate"}'
SKIPPED = 'sweeper_completions_total{outcome="skipped",policy="expired-carts"}'


def counter(metrics: httpx.Response, series: str) -> float:
    """A series' value in this process (a counter: other tests in the process add to it)."""
    [value] = [row.removeprefix(series + " ") for row in metrics.text.splitlines()
               if row.startswith(series + " ")]
    return float(value)


async def test_report_only_then_delete_then_collect_what_was_left(
        db_url: str, store_db_url: str, store: asyncpg.Connection) -> None:
    # 60 expired carts over three shops, 5 active ones, and abandoned checkouts
    await store.execute("INSERT INTO carts (shop, updated_at) SELECT 'shop-' || (i % 3), "
                        "now() - interval '30 days' - i * interval '1 minute' "
                        "FROM generate_series(1, 60) i")
    await store.execute("INSERT INTO carts (shop, updated_at) SELECT 'shop-0', now() "
                        "FROM generate_series(1, 5)")
    await store.execute("INSERT INTO checkouts (shop, created_at) SELECT 'shop-1', "
                        "now() - interval '3 days' FROM generate_series(1, 7)")
    await store.execute("INSERT INTO checkouts (shop, created_at, completed_at) SELECT "
                        "'shop-1', now() - interval '3 days', now() FROM generate_series(1, 4)")
    policies = store_policies(store_db_url)
    settings = test_settings(db_url, workers=4)
    async with LiveServer(settings, policies, db_url) as live, live.client() as client:
        live.count_progress_afresh()
        before = counter(await client.get("/metrics"), DISCOVERED)
        dry = (await client.post("/v1/runs", json={"policy": "expired-carts",
                                                   "dry_run": True})).json()
        dry = await wait_run(client, dry["id"], drained=False)
        assert dry["candidates"] == 60 and dry["released"] == 0
        figures = dry["report"]["policies"]["expired-carts"]
        assert figures["candidates"] == 60 and figures["source"]["pages"] == 2
        assert await store.fetchval("SELECT count(*) FROM carts") == 65  # nothing deleted
        # per tenant, and against the previous report-only run: a shop's carts come back
        await store.execute("UPDATE carts SET updated_at = now() WHERE shop = 'shop-2'")
        again = (await client.post("/v1/runs", json={"policy": "expired-carts",
                                                     "dry_run": True})).json()
        again = await wait_run(client, again["id"], drained=False)
        assert again["candidates"] == 40
        assert again["report"]["previous_dry_run"] == {
            "run_id": dry["id"], "candidates": 60, "difference": -20}
        found = (await client.get(f"/v1/runs/{again['id']}/discovery")).json()
        assert found["previous_dry_run"] == dry["id"]
        [walk] = found["policies"]
        assert walk["done"] and (walk["candidates"], walk["registered"]) == (40, 0)
        assert {t["tenant_id"]: (t["candidates"], t["previous_candidates"], t["difference"])
                for t in walk["tenants"]} == {"shop-0": (20, 20, 0), "shop-1": (20, 20, 0),
                                              "shop-2": (0, 20, -20)}
        assert counter(await client.get("/metrics"), DISCOVERED) == before + 100
        await store.execute("UPDATE carts SET updated_at = now() - interval '30 days' "
                            "WHERE shop = 'shop-2'")

        real = (await client.post("/v1/runs", json={})).json()
        real = await wait_run(client, real["id"], drained=True)
        assert real["candidates"] == 67, real
        assert real["items"] == {"succeeded": 67}
        assert await store.fetchval("SELECT count(*) FROM carts") == 5
        assert await store.fetchval("SELECT count(*) FROM checkouts") == 4


async def test_a_row_active_again_is_skipped_and_a_later_run_collects_it(
        db_url: str, store_db_url: str, store: asyncpg.Connection) -> None:
    await store.execute("INSERT INTO carts (shop, updated_at) SELECT 'shop-' || (i % 2), "
                        "now() - interval '30 days' FROM generate_series(1, 30) i")
    policies = store_policies(store_db_url)
    async with LiveServer(test_settings(db_url, workers=4), policies, db_url) as live, \
            live.client() as client:
        live.count_progress_afresh()
        # published (discovered and released) while no worker claims: then three shoppers
        # come back to their carts before the deletion runs
        skipped_before = counter(await client.get("/metrics"), SKIPPED)
        assert (await client.post("/v1/workers/pause", json={"reason": "rehearsal"})
                ).status_code == 200
        run = (await client.post("/v1/runs", json={"policy": "expired-carts"})).json()
        run = await wait_run(client, run["id"], drained=False)
        assert run["released"] == 30
        await store.execute("UPDATE carts SET updated_at = now() WHERE id <= 3")
        assert (await client.post("/v1/workers/resume", json={})).status_code == 200
        run = await wait_run(client, run["id"], drained=True)
        assert run["items"] == {"succeeded": 27, "skipped": 3}
        assert run["attempts"] == {"succeeded": 27, "skipped": 3}
        assert sorted(r["id"] for r in await store.fetch("SELECT id FROM carts")) == [1, 2, 3]
        skipped = (await client.get("/v1/items", params={"status": "skipped"})).json()
        assert sorted(i["object_id"] for i in skipped["items"]) == ["1", "2", "3"]
        assert {i["last_outcome"] for i in skipped["items"]} == {"skipped"}
        assert counter(await client.get("/metrics"), SKIPPED) == skipped_before + 3

        # the schedule was paused a week; meanwhile those carts were abandoned again and
        # new ones expired: the next run, with its later cutoff, finds them all
        await store.execute("UPDATE carts SET updated_at = now() - interval '20 days'")
        await store.execute("INSERT INTO carts (shop, updated_at) SELECT 'shop-2', "
                            "now() - interval '10 days' FROM generate_series(1, 4)")
        later = (await client.post("/v1/runs", json={"policy": "expired-carts"})).json()
        later = await wait_run(client, later["id"], drained=True)
        assert later["candidates"] == 7 and later["items"] == {"succeeded": 7}
        assert await store.fetchval("SELECT count(*) FROM carts") == 0
        # the re-armed items are the same obligations, each deleted once
        items = (await client.get("/v1/items", params={"status": "succeeded",
                                                       "limit": 100})).json()["items"]
        assert len(items) == 34 and len({i["object_id"] for i in items}) == 34


class FailingStores(Stores):
    """A store that answers `pages` pages, then is unreachable."""

    def __init__(self, stores: Stores, pages: int) -> None:
        super().__init__(stores.stores)
        self.left = pages

    async def read_page(self, *args: Any, **kwargs: Any) -> SourceRows:
        if self.left == 0:
            raise StoreError("shop", Failure.STORE_UNREACHABLE, "ConnectionRefusedError")
        self.left -= 1
        return await super().read_page(*args, **kwargs)


async def test_discovery_resumes_after_a_crash_and_counts_malformed_rows(
        engine: AsyncEngine, store_db_url: str, store: asyncpg.Connection) -> None:
    await store.execute("INSERT INTO carts (shop, updated_at) SELECT 'shop-' || (i % 4), "
                        "now() - interval '30 days' - i * interval '1 second' "
                        "FROM generate_series(1, 230) i")
    # three rows no item can be made of: an empty tenant, a control character, 600 bytes
    await store.execute("INSERT INTO carts (shop, updated_at) VALUES "
                        "('', now() - interval '9 days'), (E'bad\\x01shop', now() - "
                        "interval '9 days'), (repeat('x', 600), now() - interval '9 days')")
    policies = store_policies(store_db_url)
    stores = Stores(policies.stores)
    run_id, _ = await trigger.create_run(engine, trigger.RunRequest("expired-carts", None,
                                                                    None,
                                                                    False, None), None)
    try:
        flaky = FailingStores(stores, pages=2)
        with pytest.raises(StoreError):
            await publication.publish(engine, run_id, batch_size=50,
                                      discovery=Discovery(policies, flaky))
        report = await discovery.report(engine, run_id)
        assert report is not None
        [walk] = report["policies"]
        assert walk["pages"] == 2 and walk["candidates"] == 100 and not walk["done"]
        assert "store_unreachable" in walk["failure"]
        async with engine.connect() as conn:
            state = (await conn.execute(text("SELECT state, released FROM runs"))).one()
        assert tuple(state) == ("publishing", 0)  # waits for the store, nothing lost
        # a publisher on another replica picks the run up where the cursor stands
        assert await publication.publish_pending(engine, batch_size=50,
                                                 discovery=Discovery(policies, stores)) == 1
        await flaky.aclose()
    finally:
        await stores.aclose()
    report = await discovery.report(engine, run_id)
    assert report is not None
    [walk] = report["policies"]
    assert walk["done"] and walk["failure"] is None
    assert (walk["candidates"], walk["registered"], walk["errors"]) == (230, 230, 3)
    assert sorted(s["problem"] for s in walk["error_samples"]) == [
        "tenant_id must be at most 512 bytes",
        "tenant_id must not be empty",
        "tenant_id must not contain control characters or unpaired surrogates"]
    assert sum(t["candidates"] for t in walk["tenants"]) == 230
    async with engine.connect() as conn:
        counts = (await conn.execute(text(
            "SELECT count(*), count(DISTINCT object_id), count(batch_id) FROM items"))).one()
        run = (await conn.execute(text("SELECT state, candidates, released FROM runs"))).one()
    assert tuple(counts) == (230, 230, 230)  # each registered once, all released
    assert tuple(run) == ("published", 230, 230)


async def publish_carts(engine: AsyncEngine, policies: Policies) -> list[claims.Lease]:
    """Discover and release the expired carts; lease them all."""
    stores = Stores(policies.stores)
    try:
        run_id, _ = await trigger.create_run(engine, trigger.RunRequest(
            "expired-carts", None, None, False, None), None)
        assert await publication.publish(engine, run_id, batch_size=100,
                                         discovery=Discovery(policies, stores))
    finally:
        await stores.aclose()
    admitted = await claims.admit(engine, owner="t", wants={SCOPE: 10},
                                  lease_seconds={"expired-carts": 30}, lookahead_s=0)
    return admitted.leases


SCOPE = "store:shop:expired-carts"


async def test_a_redelivered_batch_deletes_nothing_twice(
        engine: AsyncEngine, store_db_url: str, store: asyncpg.Connection) -> None:
    await store.execute("INSERT INTO carts (shop, updated_at) SELECT 'shop-1', "
                        "now() - interval '30 days' FROM generate_series(1, 6)")
    policies = store_policies(store_db_url)
    policy = policies.policies["expired-carts"]
    leases = await publish_carts(engine, policies)
    assert len(leases) == 6
    stores = Stores(policies.stores)
    target = StoreTargets(stores, engine)
    try:
        first = await target.delete(policy, leases[:4])
        assert first.verdict is not None and first.verdict.outcome is Outcome.SUCCEEDED
        assert first.skipped == frozenset() and first.rows == 4
        assert await store.fetchval("SELECT count(*) FROM carts") == 2
        # the worker died before the ledger heard: the same batch again finds its record
        await store.execute("INSERT INTO carts (shop, updated_at) OVERRIDING SYSTEM VALUE "
                            "SELECT 'shop-1', now() - interval '30 days' FROM carts LIMIT 0")
        again = await target.delete(policy, leases[:4])
        assert again.verdict == first.verdict and again.skipped == frozenset()
        # redelivered in another grouping, beside two never tried: the first four count as
        # deleted (an earlier batch of this policy version recorded them), the rest run
        retried = [dataclasses.replace(lease, attempt=2) for lease in leases[2:4]]
        mixed = await target.delete(policy, [*retried, *leases[4:]])
        assert mixed.skipped == frozenset() and mixed.rows == 4
        assert await store.fetchval("SELECT count(*) FROM carts") == 0
        recorded = await store.fetch("SELECT objects AS n, "
                                     "cardinality(deleted) AS d FROM cleanup_ledger "
                                     "ORDER BY deleted_at")
        assert [(r["n"], r["d"]) for r in recorded] == [(4, 4), (4, 2)]
    finally:
        await stores.aclose()


async def test_retention_prunes_the_store_ledger_by_age_and_leaves_an_unindexed_one(
        engine: AsyncEngine, store_db_url: str, store: asyncpg.Connection,
        caplog: pytest.LogCaptureFixture) -> None:
    await store.execute("INSERT INTO carts (shop, updated_at) SELECT 'shop-1', "
                        "now() - interval '30 days' FROM generate_series(1, 5)")
    policies = store_policies(store_db_url)
    leases = await publish_carts(engine, policies)
    ledgers = ledger_tables(policies)
    assert ledgers == {"shop": "cleanup_ledger"}
    stores = Stores(policies.stores)
    try:
        for lease in leases:  # five batches: the ledger table is created with its index
            await StoreTargets(stores, engine).delete(policies.policies["expired-carts"],
                                                      [lease])
        await store.execute("UPDATE cleanup_ledger SET deleted_at = now() - interval '40 "
                            "days' WHERE identity IN (SELECT identity FROM cleanup_ledger "
                            "ORDER BY identity LIMIT 3)")
        before = metrics.REGISTRY.get_sample_value("sweeper_retention_pruned_total",
                                                   {"table": "store_ledger"}) or 0

        pruned = await retention.prune(engine, keep_seconds=30 * 86_400, batch_size=2,
                                       evidence_keep_seconds=0, stores=stores,
                                       ledgers=ledgers)

        assert pruned.store_ledgers == 3
        assert await store.fetchval("SELECT count(*) FROM cleanup_ledger WHERE deleted_at "
                                    "> now() - interval '1 day'") == 2
        assert await store.fetchval("SELECT count(*) FROM cleanup_ledger") == 2
        assert metrics.REGISTRY.get_sample_value("sweeper_retention_pruned_total",
                                                 {"table": "store_ledger"}) == before + 3
        # a table a DBA created without the index: pruning it would read it whole each batch
        await store.execute("DROP INDEX cleanup_ledger_deleted_at; UPDATE cleanup_ledger SET "
                            "deleted_at = now() - interval '40 days'")
        assert await retention.prune_store_ledgers(stores, ledgers, keep_seconds=30 * 86_400,
                                                   batch_size=2) == 0
        assert await store.fetchval("SELECT count(*) FROM cleanup_ledger") == 2
        assert any(r.getMessage() == "store ledger not pruned: it has no index on deleted_at"
                   for r in caplog.records)
        # a store out of reach is left for the next pass, and the rest of retention goes on
        away = store_policies("postgresql://postgres@127.0.0.1:9/nowhere")
        unreachable = Stores(away.stores)
        try:
            assert await retention.prune(engine, keep_seconds=30 * 86_400, batch_size=2,
                                         evidence_keep_seconds=0, stores=unreachable,
                                         ledgers=ledgers) == retention.Pruned(0, 0)
        finally:
            await unreachable.aclose()
    finally:
        await stores.aclose()


@pytest.mark.parametrize(("setup", "statement", "outcome", "reason"), [
    # another transaction holds the row: the lock timeout undoes the statement
    ("lock", None, Outcome.TRANSIENT, "store_busy"),
    # the target's role may not delete: the scope pauses, the item waits unpunished
    ("revoke", None, Outcome.UNAUTHORIZED, "store_permission_denied"),
    # a statement the store refuses for what it is
    (None, "DELETE FROM carts WHERE id = ANY(CAST(:object_ids AS bigint[])) AND updated_at < "
           ":cutoff AND 1 / 0 = 1 RETURNING id::text AS object_id", Outcome.PERMANENT,
     "store_refused"),
])
async def test_store_failures_are_classified(
        engine: AsyncEngine, store_db_url: str, store: asyncpg.Connection,
        setup: str | None, statement: str | None, outcome: Outcome, reason: str) -> None:
    await store.execute("INSERT INTO carts (shop, updated_at) VALUES "
                        "('shop-1', now() - interval '30 days')")
    url = store_db_url
    if setup == "revoke":
        await store.execute("CREATE ROLE sweeper_reader LOGIN; GRANT SELECT ON carts TO "
                            "sweeper_reader; GRANT CREATE ON SCHEMA public TO sweeper_reader")
        url = str(make_url(store_db_url).set(username="sweeper_reader"))
    overrides: dict[str, Any] = {}
    if statement is not None:
        overrides["target"] = {"store": "shop", "statement": statement}
    policies = store_policies(url, **overrides)
    leases = await publish_carts(engine, store_policies(store_db_url, **overrides))
    stores = Stores(policies.stores)
    locker = await asyncpg.connect(store_db_url)
    try:
        if setup == "lock":
            await locker.execute("BEGIN; SELECT * FROM carts FOR UPDATE")
        result = await StoreTargets(stores, engine).delete(policies.policies["expired-carts"],
                                                           leases)
        verdict = classify(result.answer, absent_means_deleted=False, now=datetime.now(UTC))
        assert (verdict.outcome, verdict.reason) == (outcome, reason)
        assert await store.fetchval("SELECT count(*) FROM carts") == 1
    finally:
        await locker.close()
        await stores.aclose()
        if setup == "revoke":
            await store.execute("DROP OWNED BY sweeper_reader; DROP ROLE sweeper_reader")


@contextlib.asynccontextmanager
async def forwarding(port: int, to_url: str) -> AsyncIterator[None]:
    """Listen on `port` and pass each connection through to the server of `to_url`: the
    store answering again on the address it was unreachable at."""
    target = make_url(to_url)
    socket_dir = target.query.get("host")  # the embedded server listens on a socket only

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if isinstance(socket_dir, str):
            return await asyncio.open_unix_connection(
                f"{socket_dir}/.s.PGSQL.{target.port or 5432}")
        return await asyncio.open_connection(target.host, target.port or 5432)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await connect()
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(accept, "127.0.0.1", port)
    try:
        yield
    finally:
        server.close()


@pytest.mark.slow  # the paused scope stays held here for LOCAL_HOLD_S (1 s) after it
async def test_an_unreachable_store_pauses_the_scope_loses_nothing_and_resumes_when_it_answers(
        engine: AsyncEngine, store_db_url: str, store: asyncpg.Connection) -> None:
    await store.execute("INSERT INTO carts (shop, updated_at) SELECT 'shop-1', "
                        "now() - interval '30 days' FROM generate_series(1, 5)")
    await publish_carts(engine, store_policies(store_db_url))
    async with engine.begin() as conn:  # the leases taken above expire
        await conn.execute(text("UPDATE items SET lease_expires_at = now() - interval '1 s'"))
    port = free_port()
    # the store's address, with nothing listening there yet
    real = make_url(store_db_url)
    moved = f"postgresql://{real.username}@127.0.0.1:{port}/{real.database}"
    policies = store_policies(moved)
    stores = Stores(policies.stores)
    try:
        pool = database_pool(engine, policies, Upstreams({}), concurrency=4, stores=stores)
        await drain(pool, engine, rounds=5)
        async with engine.connect() as conn:
            scope = (await conn.execute(text(
                "SELECT name, paused, paused_reason FROM scopes"))).one()
            items = (await conn.execute(text(
                "SELECT status, attempts, last_error FROM items ORDER BY id"))).all()
        assert tuple(scope)[1:] == (True, "store-unreachable")
        # the one attempt is the first lease's (its worker "died"); the store's refusal is
        # not held against the items
        assert {tuple(i) for i in items} == {("pending", 1, "store_unreachable")}
        assert await store.fetchval("SELECT count(*) FROM carts") == 5
        # still down: the look leaves it paused
        assert await scope_resumption.resume_reachable(engine, policies, stores) == []

        # the store answers on that address again: the waiting loop resumes the scope (as
        # the system, audited) and the items are deleted, each attempt counted once more
        async with forwarding(port, store_db_url):
            loop = asyncio.create_task(scope_resumption.waiting_loop(engine, policies,
                                                                     Credentials({}),
                                                                     stores, interval_s=0.05))
            try:
                async with asyncio.timeout(10):
                    while (await scope_controls.list_scopes(engine, name=scope.name))[0]["paused"]:
                        await asyncio.sleep(0.05)
            finally:
                loop.cancel()
            await drain(pool, engine)  # the same pool: its next rounds find the scope open
    finally:
        await stores.aclose()
    async with engine.connect() as conn:
        items = (await conn.execute(text("SELECT status, attempts FROM items"))).all()
        audit = (await conn.execute(text(
            "SELECT actor, action, reason, details FROM operator_actions ORDER BY id"))).all()
    assert {tuple(i) for i in items} == {("succeeded", 2)}
    assert await store.fetchval("SELECT count(*) FROM carts") == 0
    assert [(a.actor, a.action, a.reason, a.details) for a in audit] == [
        ("sweeper:stores", "scope.resume", "its store answers again",
         {"scope": scope.name, "paused_reason": "store-unreachable"})]


@pytest.mark.slow  # the guard's backoff is a real second
async def test_a_guard_over_its_threshold_closes_the_scope_with_the_reason(
        db_url: str, store_db_url: str, store: asyncpg.Connection) -> None:
    await store.execute("INSERT INTO carts (shop, updated_at) SELECT 'shop-1', "
                        "now() - interval '30 days' FROM generate_series(1, 5)")
    await store.execute("CREATE TABLE pressure (n integer); INSERT INTO pressure VALUES (50)")
    guard = {"store": "shop", "query": "SELECT n FROM pressure", "max": 10,
             "backoff_seconds": 1, "every_seconds": 0.05}
    policies = store_policies(store_db_url, guard=guard)
    async with LiveServer(test_settings(db_url, workers=2), policies, db_url) as live, \
            live.client() as client:
        live.count_progress_afresh()
        run = (await client.post("/v1/runs", json={"policy": "expired-carts"})).json()
        async with asyncio.timeout(10):
            while True:
                [scope] = (await client.get("/v1/scopes")).json()["scopes"] or [None]
                if scope is not None and scope["closed_until"] is not None:
                    break
                await asyncio.sleep(0.05)
        assert scope["closed_reason"] == "store_guard"
        assert await store.fetchval("SELECT count(*) FROM carts") == 5
        # the shoppers leave: once the backoff is over the deletions run
        await store.execute("UPDATE pressure SET n = 1")
        run = await wait_run(client, run["id"], drained=True)
        assert run["items"] == {"succeeded": 5}
        assert await store.fetchval("SELECT count(*) FROM carts") == 0


def policies_toml(source_sql: str, target_sql: str) -> str:
    return f"""
[stores.shop]
dsn_env = "SHOP_DATABASE_URL"

[policies.expired-carts]
version = 1
source = {{ store = "shop", query = {json.dumps(source_sql)} }}
target = {{ store = "shop", statement = {json.dumps(target_sql)} }}
batch = {{ max_objects = 500 }}
scope = "store:{{upstream}}:{{policy}}"
rate = {{ per_second = 20000, burst = 2000, unit = "rows" }}
"""


@pytest.mark.slow  # a sweeper process per command
@pytest.mark.parametrize("command", [["check-config"], ["worker"]])
def test_a_query_returning_the_wrong_columns_is_refused_at_start_up(
        tmp_path: Path, store_db_url: str, store: asyncpg.Connection,
        command: list[str]) -> None:
    path = tmp_path / "policies.toml"
    path.write_text(policies_toml(CARTS_SOURCE.replace("updated_at AS age", "updated_at"),
                                  CARTS_TARGET.replace("AS object_id", "")))
    result = sweeper(*command, env={"SWEEPER_POLICIES_FILE": str(path), "SWEEPER_WORKERS": "1",
                                    "SHOP_DATABASE_URL": store_db_url,
                                    "SWEEPER_DATABASE_URL": "postgresql://127.0.0.1:9/x"})
    assert result.returncode == 2, result.stderr
    assert "policies.expired-carts.source.query: must return the columns tenant_id, " \
           "object_id, age; missing age" in result.stderr
    assert "policies.expired-carts.target.statement: must return the column object_id" \
        in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # four sweeper check-config processes
def test_check_config_shows_each_statement_and_its_plan(
        tmp_path: Path, store_db_url: str, store: asyncpg.Connection) -> None:
    path = tmp_path / "policies.toml"
    path.write_text(policies_toml(CARTS_SOURCE, CARTS_TARGET))
    result = sweeper("check-config", "--explain", env={"SWEEPER_POLICIES_FILE": str(path),
                                                       "SHOP_DATABASE_URL": store_db_url})
    assert result.returncode == 0, result.stderr
    assert "1 store(s), 1 policy(ies)" in result.stdout
    assert "policies.expired-carts.source on store 'shop':" in result.stdout
    assert "policies.expired-carts.target on store 'shop':" in result.stdout
    assert result.stdout.count("plan:") == 2 and "Delete on carts" in result.stdout
    # a source query that would lock or write the store's rows is refused, whatever its
    # first word says: by its plan, or by the store itself
    for query, words in ((CARTS_SOURCE + " FOR UPDATE", "must be read-only"),
                         ("WITH gone AS (DELETE FROM carts WHERE updated_at < :cutoff "
                          "RETURNING *) SELECT shop AS tenant_id, id AS object_id, updated_at "
                          "AS age FROM gone", "the store refused it")):
        path.write_text(policies_toml(query, CARTS_TARGET))
        result = sweeper("check-config", env={"SWEEPER_POLICIES_FILE": str(path),
                                              "SHOP_DATABASE_URL": store_db_url})
        assert result.returncode == 2
        assert f"policies.expired-carts.source.query: {words}" in result.stderr
    # a store out of reach is a warning: its scopes pause until it answers
    result = sweeper("check-config", env={
        "SWEEPER_POLICIES_FILE": str(path),
        "SHOP_DATABASE_URL": f"postgresql://postgres@127.0.0.1:{free_port()}/shop"})
    assert result.returncode == 0, result.stderr
    assert "stores.shop: cannot be reached (store_unreachable" in result.stderr


@pytest.mark.parametrize(("guard", "expected"), [
    # other active client backends of the server (other tests': some number, never None)
    ({"active_backends": True, "max": 5}, "a count"),
    # no replica of that name streams from this server: unknown, which counts as over
    ({"replica_lag": "replica-1", "max": 5}, None),
    ({"query": "SELECT 42", "max": 5}, 42.0),
    ({"query": "SELECT 'many'", "max": 5}, None),  # not a number: over
])
async def test_each_guard_reads_its_number(store_db_url: str, store: asyncpg.Connection,
                                           guard: dict[str, Any],
                                           expected: float | str | None) -> None:
    stores = Stores(store_policies(store_db_url).stores)
    try:
        value = await stores.guard_value(GuardConfig(store="shop", **guard))
    finally:
        await stores.aclose()
    if expected == "a count":
        assert value is not None and value >= 0 and value == int(value)
    else:
        assert value == expected

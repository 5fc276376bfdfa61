"""The ledger's invariants live in PostgreSQL: each constraint rejects what it should."""

from __future__ import annotations

import hashlib
import importlib
import uuid
from datetime import datetime

import asyncpg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy.ext.asyncio import AsyncEngine

from service.config.settings import async_url
from service.db import migrate
from service.db.engine import make_engine
from service.db.tables import metadata
from service.ledger import registration
from tests.conftest import test_settings
from tests.integration.test_pipeline import PAST, make_policies

_CHEAPER_CHECKS = importlib.import_module("migrations.versions.0006_cheaper_checks")
OLD_RULES: dict[tuple[str, str], str] = _CHEAPER_CHECKS.OLD
NEW_RULES: dict[tuple[str, str], str] = _CHEAPER_CHECKS.NEW

KEY = hashlib.sha256(b"k").hexdigest()


@pytest.fixture
async def conn(db_url: str) -> asyncpg.Connection:
    connection = await asyncpg.connect(db_url)
    yield connection
    await connection.close()


async def insert_item(conn: asyncpg.Connection, **overrides: object) -> int:
    row: dict[str, object] = {
        "tenant_id": "acme", "object_id": "cart-1", "policy": "cart-retention",
        "policy_version": 1, "operation_key": KEY, "scope": "tenant:acme",
        "due_at": "2026-01-01T00:00:00Z",
    }
    row.update(overrides)
    cols = ", ".join(row)
    params = ", ".join(f"${i}" for i in range(1, len(row) + 1))
    values = [datetime.fromisoformat(v) if k.endswith("_at") and isinstance(v, str) else v
              for k, v in row.items()]
    return int(await conn.fetchval(f"INSERT INTO items ({cols}) VALUES ({params}) RETURNING id",
                                   *values))


async def test_a_valid_item_is_accepted(conn: asyncpg.Connection) -> None:
    item_id = await insert_item(conn)
    row = await conn.fetchrow("SELECT status, attempts, next_attempt_at FROM items WHERE id=$1",
                              item_id)
    assert row["status"] == "pending" and row["attempts"] == 0


async def test_obligation_is_unique(conn: asyncpg.Connection) -> None:
    await insert_item(conn)
    with pytest.raises(asyncpg.UniqueViolationError, match="items_obligation"):
        await insert_item(conn, operation_key=hashlib.sha256(b"other").hexdigest())
    # another policy version is another obligation
    await insert_item(conn, policy_version=2, operation_key=hashlib.sha256(b"v2").hexdigest())


async def test_operation_key_is_the_obligations_own(engine: AsyncEngine,
                                                    conn: asyncpg.Connection) -> None:
    # The key has no unique index of its own (revision 0004): it is unique because it is a
    # function of the obligation, which is. Every writer must derive it so.
    policy = make_policies("http://127.0.0.1:9").policies["carts"]
    await registration.register(engine, [registration.Registration(t, o, policy, PAST) for t, o in
                                   (("acme", "c1"), ("acme", "c2"), ("globex", "c1"))])
    rows = await conn.fetch(
        "SELECT tenant_id, object_id, policy, policy_version, operation_key FROM items")
    indexes = await conn.fetch("SELECT indexname FROM pg_indexes WHERE tablename = 'items' "
                               "AND indexdef LIKE '%(operation_key)%'")
    assert len(rows) == 3 and len({r["operation_key"] for r in rows}) == 3
    for r in rows:
        assert r["operation_key"] == registration.operation_key(
            r["tenant_id"], r["object_id"], r["policy"], r["policy_version"])
    assert indexes == []


@pytest.mark.parametrize(
    "overrides",
    [
        {"status": "finished"},
        {"object_id": ""},
        {"object_id": "x" * 513},
        {"object_id": "bad\nid"},
        {"tenant_id": "t\x00"[:1] + "\x07"},
        {"policy": "Cart Retention"},
        {"policy_version": 0},
        {"operation_key": "not-a-digest"},
        {"attempts": -1},
        {"last_outcome": "maybe"},
        {"last_status_code": 600},
        # `leased` is no status: a leased item is pending with a lease (0024)
        {"status": "leased", "released_at": "2026-01-01T00:00:00Z", "lease_owner": "w",
         "lease_token": uuid.uuid4(), "lease_expires_at": "2026-01-01T00:00:00Z"},
        # half a lease
        {"released_at": "2026-01-01T00:00:00Z", "lease_owner": "w",
         "lease_token": uuid.uuid4()},
        # a lease on a finished item
        {"status": "dead", "dead_reason": "x", "completed_at": "2026-01-01T00:00:00Z",
         "released_at": "2026-01-01T00:00:00Z", "lease_owner": "w",
         "lease_token": uuid.uuid4(), "lease_expires_at": "2026-01-01T00:00:00Z"},
        # dead without a reason
        {"status": "dead", "completed_at": "2026-01-01T00:00:00Z"},
        # succeeded without completed_at
        {"status": "succeeded"},
        # a completed_at on a pending item
        {"completed_at": "2026-01-01T00:00:00Z"},
        # a lease on an unreleased item
        {"lease_owner": "w", "lease_token": uuid.uuid4(),
         "lease_expires_at": "2026-01-01T00:00:00Z"},
        # lease columns on a pending item
        {"lease_owner": "w"},
    ],
)
async def test_item_check_constraints(conn: asyncpg.Connection, overrides: dict[str, object]
                                      ) -> None:
    with pytest.raises(asyncpg.CheckViolationError):
        await insert_item(conn, **overrides)


async def test_deleting_a_run_clears_its_items_batch_references(conn: asyncpg.Connection
                                                                 ) -> None:
    """items.batch_id has no foreign key (migration 0007); deleting batches, here with
    their run, sets the references to NULL as ON DELETE SET NULL did, and only those."""
    runs = [await conn.fetchval("INSERT INTO runs (request_digest, cutoff) VALUES ('d', now()) "
                                "RETURNING id") for _ in range(2)]
    batches = [await conn.fetchval(
        "INSERT INTO batches (run_id, seq, digest, policy, policy_version, item_count) "
        "VALUES ($1, $2, $3, 'p', 1, 1) RETURNING id",
        run, seq, hashlib.sha256(str(seq).encode()).hexdigest())
        for seq, run in enumerate([runs[0], runs[0], runs[1]])]
    items = [await insert_item(conn, object_id=f"o{n}", operation_key=f"{n:064x}",
                               released_at="2026-01-01T00:00:00Z", batch_id=batch)
             for n, batch in enumerate(batches)]
    await conn.execute("DELETE FROM runs WHERE id = $1", runs[0])
    left = await conn.fetch("SELECT id, batch_id FROM items ORDER BY id")
    assert [(r["id"], r["batch_id"]) for r in left] == [
        (items[0], None), (items[1], None), (items[2], batches[2])]


async def test_run_trigger_key_is_unique(conn: asyncpg.Connection) -> None:
    insert = ("INSERT INTO runs (trigger_key, request_digest, cutoff) "
              "VALUES ($1, 'd', now()) RETURNING id")
    await conn.fetchval(insert, "cron-2026-11-29T00:00")
    with pytest.raises(asyncpg.UniqueViolationError):
        await conn.fetchval(insert, "cron-2026-11-29T00:00")
    await conn.fetchval(insert, None)
    await conn.fetchval(insert, None)  # runs without a key are not de-duplicated


async def test_run_state_rules(conn: asyncpg.Connection) -> None:
    with pytest.raises(asyncpg.CheckViolationError):
        await conn.execute("INSERT INTO runs (request_digest, cutoff, state) "
                           "VALUES ('d', now(), 'exploded')")
    with pytest.raises(asyncpg.CheckViolationError):
        await conn.execute("INSERT INTO runs (request_digest, cutoff, state) "
                           "VALUES ('d', now(), 'published')")  # no published_at
    with pytest.raises(asyncpg.CheckViolationError):
        await conn.execute("INSERT INTO runs (request_digest, cutoff, max_items) "
                           "VALUES ('d', now(), 0)")


async def test_batches_reference_runs_and_are_unique(conn: asyncpg.Connection) -> None:
    with pytest.raises(asyncpg.ForeignKeyViolationError):
        await conn.execute("INSERT INTO batches (run_id, seq, digest, policy, policy_version, "
                           "item_count) VALUES (1, 0, $1, 'p', 1, 1)", KEY)
    run_id = await conn.fetchval("INSERT INTO runs (request_digest, cutoff) VALUES ('d', now()) "
                                 "RETURNING id")
    insert = ("INSERT INTO batches (run_id, seq, digest, policy, policy_version, item_count) "
              "VALUES ($1, $2, $3, 'p', 1, 1)")
    await conn.execute(insert, run_id, 0, KEY)
    with pytest.raises(asyncpg.UniqueViolationError):
        await conn.execute(insert, run_id, 1, KEY)  # same digest
    with pytest.raises(asyncpg.UniqueViolationError):
        await conn.execute(insert, run_id, 0, hashlib.sha256(b"x").hexdigest())  # same seq
    with pytest.raises(asyncpg.CheckViolationError):
        await conn.execute(insert, run_id, 2, "short")


async def test_attempt_rules(conn: asyncpg.Connection) -> None:
    item_id = await insert_item(conn)
    insert = ("INSERT INTO attempts (item_id, attempt_no, worker, lease_token, started_at, "
              "finished_at, outcome, latency_ms, http_status) "
              "VALUES ($1, $2, 'w', $3, now(), now() + make_interval(secs => $4), $5, 1.5, $6)")
    token = uuid.uuid4()
    await conn.execute(insert, item_id, 1, token, 1.0, "succeeded", 204)
    for args in [(item_id, 0, token, 1.0, "succeeded", 204),
                 (item_id, 1, token, -1.0, "succeeded", 204),
                 (item_id, 1, token, 1.0, "fine", 204),
                 (item_id, 1, token, 1.0, "succeeded", 99)]:
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute(insert, *args)
    with pytest.raises(asyncpg.ForeignKeyViolationError):
        await conn.execute(insert, item_id + 100, 1, token, 1.0, "succeeded", 204)
    # attempts go with their item (self-retention prunes both)
    await conn.execute("DELETE FROM items WHERE id = $1", item_id)
    assert await conn.fetchval("SELECT count(*) FROM attempts") == 0


async def test_scope_rules(conn: asyncpg.Connection) -> None:
    insert = ("INSERT INTO scopes (name, rate_per_second, burst, tokens, paused, paused_reason) "
              "VALUES ($1, $2, $3, $4, $5, $6)")
    await conn.execute(insert, "tenant:acme", 5.0, 5, 5.0, False, None)
    bad = [("tenant:b", 0.0, 5, 1.0, False, None),      # no rate
           ("tenant:c", 5.0, 0, 0.0, False, None),      # no burst
           ("tenant:d", 5.0, 5, 6.0, False, None),      # more tokens than burst
           ("tenant:f", 5.0, 5, 1.0, True, None),       # paused without a reason
           ("tenant:g", 5.0, 5, 1.0, False, "why")]     # a reason while running
    for args in bad:
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute(insert, *args)
    with pytest.raises(asyncpg.UniqueViolationError):
        await conn.execute(insert, "tenant:acme", 5.0, 5, 5.0, False, None)


async def test_webhook_id_is_unique_per_source(conn: asyncpg.Connection) -> None:
    insert = "INSERT INTO webhook_receipts (source, webhook_id, result) VALUES ($1, $2, $3)"
    await conn.execute(insert, "shopify", "wh-1", "applied")
    await conn.execute(insert, "standard", "wh-1", "applied")
    with pytest.raises(asyncpg.UniqueViolationError):
        await conn.execute(insert, "shopify", "wh-1", "ignored")
    with pytest.raises(asyncpg.CheckViolationError):
        await conn.execute(insert, "shopify", "wh-2", "maybe")


async def test_control_is_a_single_row(conn: asyncpg.Connection) -> None:
    assert await conn.fetchval("SELECT count(*) FROM control") == 1
    with pytest.raises(asyncpg.CheckViolationError):
        await conn.execute("INSERT INTO control (singleton) VALUES (false)")
    with pytest.raises(asyncpg.UniqueViolationError):
        await conn.execute("INSERT INTO control (singleton) VALUES (true)")


async def test_claim_indexes_are_partial(conn: asyncpg.Connection) -> None:
    defs = dict(await conn.fetch("SELECT indexname, indexdef FROM pg_indexes "
                                 "WHERE tablename = 'items'"))
    assert ("WHERE ((status = 'pending'::text) AND (released_at IS NOT NULL) "
            "AND (hold_id IS NULL))") in defs[
        "items_ready"]
    # a lease is in no index (its claim can be a HOT update), and the table leaves room
    # on each page for the new row versions of a whole claim (migrations 0024, 0027)
    assert "items_leased" not in defs
    assert not [name for name, d in defs.items()
                if any(c in d for c in ("lease_token", "lease_expires_at", "lease_owner",
                                        "attempts", "next_attempt_at", "updated_at"))]
    assert await conn.fetchval(
        "SELECT reloptions FROM pg_class WHERE relname = 'items'") == ["fillfactor=60"]


async def test_tables_module_matches_the_migrations(engine: AsyncEngine) -> None:
    def diff(sync_conn):  # type: ignore[no-untyped-def]
        ctx = MigrationContext.configure(sync_conn, opts={"compare_type": True})
        return compare_metadata(ctx, metadata)

    async with engine.connect() as c:
        changes = await c.run_sync(diff)
    # indexes and check constraints are the migration's business; columns, types,
    # nullability, keys and uniques must agree
    relevant = [ch for ch in changes
                if not (isinstance(ch, tuple) and ch[0] in ("add_index", "remove_index"))
                and not (isinstance(ch, tuple) and ch[0] == "remove_table"
                         and ch[1].name == "alembic_version")]
    assert relevant == []


async def test_upgrade_downgrade_upgrade(empty_db_url: str) -> None:
    engine = make_engine(async_url(empty_db_url), test_settings(empty_db_url))
    try:
        assert await migrate.current_revision(engine) is None
        await migrate.upgrade(engine)
        assert await migrate.current_revision(engine) == migrate.head_revision()
        await migrate.upgrade(engine)  # idempotent
        await migrate.downgrade(engine, "base")
        assert await migrate.current_revision(engine) is None
        conn = await asyncpg.connect(empty_db_url)
        try:
            tables = await conn.fetchval("SELECT count(*) FROM pg_tables "
                                         "WHERE schemaname = 'public' AND tablename <> "
                                         "'alembic_version'")
            assert tables == 0
        finally:
            await conn.close()
        await migrate.upgrade(engine)
        assert await migrate.current_revision(engine) == migrate.head_revision()
    finally:
        await engine.dispose()


async def test_concurrent_upgrades_take_turns(empty_db_url: str) -> None:
    import asyncio

    engines = [make_engine(async_url(empty_db_url), test_settings(empty_db_url))
               for _ in range(3)]
    try:
        await asyncio.gather(*(migrate.upgrade(e) for e in engines))
        assert await migrate.current_revision(engines[0]) == migrate.head_revision()
    finally:
        for e in engines:
            await e.dispose()


KEY_LIKE = ["a" * 64, "0123456789abcdef" * 4, "A" * 64, "a" * 63, "a" * 65, "g" * 64,
            "a" * 63 + "\n", "é" * 32, "a" * 62 + "é", "", " " + "a" * 63]
POLICY_LIKE = ["carts", "c", "c" * 63, "c" * 64, "cart-retention.v2_x", "-carts", ".carts",
               "_carts", "Carts", "carts!", "cart retention", "", "é", "ca\n", "9lives",
               "carts-", "a" * 62 + "é"]


@pytest.mark.parametrize(("old", "new", "values"), [
    (OLD_RULES[("items", "items_operation_key_check")],
     NEW_RULES[("items", "items_operation_key_check")], KEY_LIKE),
    (OLD_RULES[("items", "items_policy_check")],
     NEW_RULES[("items", "items_policy_check")], POLICY_LIKE),
])
async def test_cheaper_check_rules_accept_and_refuse_the_same(
        conn: asyncpg.Connection, old: str, new: str, values: list[str]) -> None:
    # revision 0006 rewrote two CHECK rules without counted repetition; they must agree
    column = "operation_key" if "operation_key" in old else "policy"
    for value in values:
        old_ok, new_ok = await conn.fetchrow(
            f"SELECT ({old}), ({new}) FROM (SELECT $1::text AS {column}) v", value)
        assert old_ok == new_ok, value


async def test_timestamps_out_of_the_api_range_are_refused(conn: asyncpg.Connection) -> None:
    for due_at in ("1969-12-31T23:59:59Z", "9999-12-31T00:00:01Z"):
        with pytest.raises(asyncpg.CheckViolationError, match="items_due_at_range"):
            await insert_item(conn, due_at=due_at)
    await insert_item(conn, due_at="1970-01-01T00:00:00Z")
    with pytest.raises(asyncpg.CheckViolationError, match="runs_cutoff_range"):
        await conn.execute("INSERT INTO runs (cutoff, dry_run, request_digest) "
                           "VALUES ('10000-01-01 00:00:00+00', false, 'd')")


async def test_migration_0009_moves_stored_timestamps_into_the_range(empty_db_url: str
                                                                     ) -> None:
    """Rows stored before the API bounded timestamps (a BC due time from
    0001-01-01T00:00:00+14:00, a cutoff in year 10000) are moved to the nearest end."""
    engine = make_engine(async_url(empty_db_url), test_settings(empty_db_url))
    conn = await asyncpg.connect(empty_db_url)
    try:
        await migrate.upgrade(engine, "0008")
        await conn.execute("SET TIME ZONE 'UTC'")
        await conn.execute(
            "INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key, "
            "scope, due_at) VALUES ('t', 'o', 'p', 1, $1, 'tenant:t', "
            "'0001-01-01 00:00:00+14:00'), ('t', 'o2', 'p', 1, $2, 'tenant:t', "
            "'2026-01-01 00:00:00+00')", KEY, hashlib.sha256(b"o2").hexdigest())
        await conn.execute("INSERT INTO runs (cutoff, dry_run, request_digest) "
                           "VALUES ('10000-01-01 00:00:00+00', false, 'd')")
        await migrate.upgrade(engine)
        due = await conn.fetch("SELECT object_id, due_at::text FROM items ORDER BY object_id")
        assert [tuple(r) for r in due] == [("o", "1970-01-01 00:00:00+00"),
                                           ("o2", "2026-01-01 00:00:00+00")]
        assert await conn.fetchval("SELECT cutoff::text FROM runs") == "9999-12-31 00:00:00+00"
    finally:
        await conn.close()
        await engine.dispose()


async def test_0024_moves_leases_in_place_and_back(empty_db_url: str) -> None:
    """A lease taken before 0024 (status `leased`) is a pending item with its lease after
    it, and `leased` again after a downgrade; other items keep their status."""
    engine = make_engine(async_url(empty_db_url), test_settings(empty_db_url))
    conn = await asyncpg.connect(empty_db_url)
    try:
        await migrate.upgrade(engine, "0023")
        await conn.execute("""
            INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key,
                               scope, status, due_at, released_at, lease_owner, lease_token,
                               lease_expires_at)
            SELECT 't', o, 'p', 1, encode(sha256(convert_to(o, 'UTF8')), 'hex'), 's',
                   CASE WHEN o = 'held' THEN 'leased' ELSE 'pending' END, now(), now(),
                   CASE WHEN o = 'held' THEN 'w' END,
                   CASE WHEN o = 'held' THEN gen_random_uuid() END,
                   CASE WHEN o = 'held' THEN now() + interval '1 min' END
            FROM unnest(ARRAY['held', 'free']) o""")
        before = await conn.fetchval("SELECT lease_token FROM items WHERE object_id = 'held'")
        await migrate.upgrade(engine)
        rows = {r["object_id"]: (r["status"], r["lease_token"]) for r in await conn.fetch(
            "SELECT object_id, status, lease_token FROM items")}
        assert rows == {"held": ("pending", before), "free": ("pending", None)}
        await migrate.downgrade(engine, "0023")
        rows = {r["object_id"]: (r["status"], r["lease_token"]) for r in await conn.fetch(
            "SELECT object_id, status, lease_token FROM items")}
        assert rows == {"held": ("leased", before), "free": ("pending", None)}
    finally:
        await conn.close()
        await engine.dispose()

"""Self-retention: Sweeper prunes its own history so the ledger does not grow forever.

Succeeded and cancelled items whose `completed_at` is older than the retention period go,
with their attempt rows (ON DELETE CASCADE), and so do webhook receipts older than it. Dead
items stay until an operator re-drives or cancels them: they are unfinished business.

Each batch is one short transaction that deletes at most `batch_size` rows found through a
partial index on finished items, so pruning ten million rows never holds a long lock and
never touches the rows claims work on (claims only see pending and leased items). Replicas
prune side by side without waiting on each other (SKIP LOCKED).

A store target's ledger table (service/sweeps/store_targets.py) goes the same way: its rows older
than the retention period, on the store's clock, in batches of the same size. A batch's row is
what makes its redelivery delete nothing twice, and no batch is redelivered after its items
finished and were pruned.

A succeeded item's deletion evidence outlives it: the statement that prunes it copies its
evidence (no payload: identifiers, policy version, operation key, outcome, upstream status,
attempts, completion time, its run) to `evidence`, kept for the evidence retention period
after completion and pruned the same way; `GET /v1/evidence` reads it. The deletion's
entry in the evidence log (service/evidence/chain.py), which exports read, is not pruned.
What pruning forgets: the item's obligation, so registering the same object again creates a
new item, whose call the upstream de-duplicates by the unchanged operation key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Final

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from service.db.statements import Statement, run
from service.observability import metrics
from service.observability.failures import repeat
from service.sweeps import store_targets
from service.sweeps.store_databases import STORE_ERRORS, Stores, describe, limit_transaction

log = logging.getLogger(__name__)

# Between batches: let claims and completions have the disk and the CPU. Pruning rests at
# least as long as its last batch took, so it keeps at most half of one database backend
# busy and the drain beside it keeps most of its throughput (bench/reports/design-notes.md).
PAUSE_BETWEEN_BATCHES_S: Final = 0.01
REST_PER_BATCH_SECOND: Final = 1.0

_PRUNE_ITEMS = Statement("retention.prune_items", (
    "Delete one batch of succeeded and cancelled items finished before the retention "
    "period (their attempts go with them), skipping rows another replica holds; succeeded "
    "ones leave their evidence behind while its own retention lasts."), """
    WITH doomed AS (
        SELECT id FROM items
        WHERE status IN ('succeeded', 'cancelled')
          AND completed_at < now() - make_interval(secs => :keep_s)
        ORDER BY completed_at
        LIMIT :batch
        FOR UPDATE SKIP LOCKED
    ),
    kept AS (
        INSERT INTO evidence (item_id, run_id, tenant_id, object_id, policy, policy_version,
                              operation_key, outcome, upstream_status, attempts, completed_at)
        SELECT i.id, b.run_id, i.tenant_id, i.object_id, i.policy, i.policy_version,
               i.operation_key, i.last_outcome, i.last_status_code, i.attempts, i.completed_at
        FROM doomed d JOIN items i ON i.id = d.id LEFT JOIN batches b ON b.id = i.batch_id
        WHERE i.status = 'succeeded'
          AND i.completed_at >= now() - make_interval(secs => :evidence_keep_s)
        ON CONFLICT (item_id) DO NOTHING
    )
    DELETE FROM items i USING doomed WHERE i.id = doomed.id
""")

# Skipped items (a store target found their row active again) keep no evidence: nothing was
# deleted. Their own partial index (0015) keeps this an ordered index scan.
_PRUNE_SKIPPED = Statement("retention.prune_skipped", (
    "Delete one batch of skipped items finished before the retention period (their "
    "attempts go with them), skipping rows another replica holds."), """
    WITH doomed AS (
        SELECT id FROM items
        WHERE status = 'skipped' AND completed_at < now() - make_interval(secs => :keep_s)
        ORDER BY completed_at
        LIMIT :batch
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM items i USING doomed WHERE i.id = doomed.id
""")

_PRUNE_EVIDENCE = Statement("retention.prune_evidence", (
    "Delete one batch of deletion evidence older than its retention period, skipping rows "
    "another replica holds."), """
    WITH doomed AS (
        SELECT item_id FROM evidence
        WHERE completed_at < now() - make_interval(secs => :keep_s)
        ORDER BY completed_at
        LIMIT :batch
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM evidence e USING doomed WHERE e.item_id = doomed.item_id
""")

_PRUNE_RECEIPTS = Statement("retention.prune_receipts", (
    "Delete one batch of webhook receipts older than the retention period, skipping rows "
    "another replica holds."), """
    WITH doomed AS (
        SELECT id FROM webhook_receipts
        WHERE received_at < now() - make_interval(secs => :keep_s)
        ORDER BY received_at
        LIMIT :batch
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM webhook_receipts r USING doomed WHERE r.id = doomed.id
""")


def _prune_minutes(table: str, key: str) -> Statement:
    return Statement(f"retention.prune_{table}", (
        f"Delete one batch of {table} older than the retention period, skipping rows "
        "another replica holds."), f"""
    WITH doomed AS (
        SELECT ctid FROM {table}
        WHERE minute < now() - make_interval(secs => :keep_s)
        ORDER BY {key}
        LIMIT :batch
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM {table} m USING doomed WHERE m.ctid = doomed.ctid""")  # noqa: S608


# the console's minutes (migration 0026), each walked through an index leading with minute
_PRUNE_MINUTES: Final = (_prune_minutes("policy_minutes", "minute, policy"),
                         _prune_minutes("scope_minutes", "minute"),
                         _prune_minutes("batch_minutes", "minute"))


@dataclass(frozen=True)
class Pruned:
    """What one pass removed."""

    items: int
    receipts: int
    evidence: int = 0
    store_ledgers: int = 0
    minutes: int = 0


async def _prune_table(engine: AsyncEngine, statement: Statement, kind: str, keep_s: float,
                       batch: int, max_batches: int | None, *,
                       prepare: Callable[[AsyncConnection], Awaitable[None]] | None = None,
                       **params: float) -> int:
    total = batches = 0
    while max_batches is None or batches < max_batches:
        started = time.monotonic()
        async with engine.begin() as conn:
            if prepare is not None:
                await prepare(conn)
            result = await run(conn, statement, {"keep_s": keep_s, "batch": batch, **params})
            deleted = result.rowcount
        batches += 1
        total += deleted
        metrics.RETENTION_PRUNED.labels(kind).inc(deleted)
        if deleted < batch:
            break
        await asyncio.sleep(max(PAUSE_BETWEEN_BATCHES_S,
                                (time.monotonic() - started) * REST_PER_BATCH_SECOND))
    return total


# a store's pruning batch is bounded like its own statements, and never queues on a lock
STORE_STATEMENT_MS: Final = 5000
STORE_LOCK_MS: Final = 200


async def _store_limits(conn: AsyncConnection) -> None:
    await limit_transaction(conn, statement_ms=STORE_STATEMENT_MS, lock_ms=STORE_LOCK_MS)


async def prune_store_ledgers(stores: Stores, ledgers: Mapping[str, str], *,
                              keep_seconds: float, batch_size: int,
                              max_batches: int | None = None) -> int:
    """Delete each store's ledger rows older than `keep_seconds`, batch by batch. A store
    out of reach, a table not there yet, or one without its index on `deleted_at` (which
    a DBA who created it by hand may lack: docs/stores.md) is left for the next pass."""
    total = 0
    for name, table in sorted(ledgers.items()):
        engine = stores.engine(name)
        try:
            async with engine.connect() as conn:
                found = (await run(conn, store_targets.LEDGER_FOUND, {"t": table})).one()
            if not found.present:
                continue
            if not found.indexed:
                log.warning("store ledger not pruned: it has no index on deleted_at",
                            extra={"store": name, "table": table,
                                   "fix": f"CREATE INDEX ON {table} (deleted_at)"})
                continue
            total += await _prune_table(engine, store_targets.ledger_prune(table), "store_ledger",
                                        keep_seconds, batch_size, max_batches,
                                        prepare=_store_limits)
        except STORE_ERRORS as exc:
            log.warning("store ledger not pruned", extra={"store": name, "table": table,
                                                          "error": describe(exc)})
    return total


async def prune(engine: AsyncEngine, *, keep_seconds: float, batch_size: int,
                evidence_keep_seconds: float, max_batches: int | None = None,
                stores: Stores | None = None, ledgers: Mapping[str, str] | None = None
                ) -> Pruned:
    """Delete finished history older than `keep_seconds` (keeping succeeded items' evidence
    until `evidence_keep_seconds` after their completion), and evidence older than that,
    and the `ledgers` (store -> table) of store targets, batch by batch, until none is left
    (or `max_batches` per table)."""
    items = await _prune_table(engine, _PRUNE_ITEMS, "items", keep_seconds, batch_size,
                               max_batches, evidence_keep_s=evidence_keep_seconds)
    items += await _prune_table(engine, _PRUNE_SKIPPED, "items", keep_seconds, batch_size,
                                max_batches)
    receipts = await _prune_table(engine, _PRUNE_RECEIPTS, "webhook_receipts", keep_seconds,
                                  batch_size, max_batches)
    evidence = await _prune_table(engine, _PRUNE_EVIDENCE, "evidence", evidence_keep_seconds,
                                  batch_size, max_batches)
    minutes = 0
    for statement in _PRUNE_MINUTES:
        minutes += await _prune_table(engine, statement, "minutes", keep_seconds, batch_size,
                                      max_batches)
    store_ledgers = await prune_store_ledgers(
        stores, ledgers, keep_seconds=keep_seconds, batch_size=batch_size,
        max_batches=max_batches) if stores is not None and ledgers else 0
    if items or receipts or evidence or store_ledgers or minutes:
        log.info("retention pruned", extra={"items": items, "webhook_receipts": receipts,
                                            "evidence": evidence,
                                            "store_ledgers": store_ledgers,
                                            "minutes": minutes})
    return Pruned(items, receipts, evidence, store_ledgers, minutes)


async def retention_loop(engine: AsyncEngine, *, keep_seconds: float, batch_size: int,
                         evidence_keep_seconds: float, interval_s: float, stores: Stores,
                         ledgers: Mapping[str, str]) -> None:
    """Prune, sleep `interval_s`, repeat until cancelled; database outages are retried."""
    await repeat(lambda: prune(engine, keep_seconds=keep_seconds, batch_size=batch_size,
                               evidence_keep_seconds=evidence_keep_seconds, stores=stores,
                               ledgers=ledgers),
                 every_s=interval_s, what="retention", logger=log)

"""Item registration and identity: the obligations Sweeper owes.

An item's operation key is a digest of exactly (tenant, object id, policy, policy version):
every attempt, from any worker, after any crash, sends the same key.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass
from datetime import datetime

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncEngine

from service import audit, limiter
from service.policies import Policy

MAX_ID_BYTES = 512


def operation_key(tenant_id: str, object_id: str, policy: str, version: int) -> str:
    """Stable idempotency key; fields are length-prefixed so no two tuples collide."""
    buffer = bytearray()
    for part in (tenant_id, object_id, policy, str(version)):
        raw = part.encode("utf-8")
        buffer += len(raw).to_bytes(4, "big")
        buffer += raw
    return hashlib.sha256(buffer).hexdigest()  # one call: this runs per registered item


# C0 and C1 control characters and DEL (the schema's CHECK refuses the same).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def id_problem(value: str) -> str | None:
    """Why `value` cannot be a tenant or object id, or None when it can. (Runs twice per
    registered item: a regular-expression search, not a Python loop over characters.)"""
    if not value:
        return "must not be empty"
    if value in (".", ".."):
        # a dot segment would be normalised away in the upstream URL, leaving its segment
        return "must not be . or .."
    # at most 4 UTF-8 bytes per character: short ids need no encoding to be measured
    if len(value) > MAX_ID_BYTES // 4 and len(value.encode("utf-8")) > MAX_ID_BYTES:
        return f"must be at most {MAX_ID_BYTES} bytes"
    if _CONTROL.search(value):
        return "must not contain control characters"
    return None


@dataclass(frozen=True)
class Registration:
    """One obligation to register."""

    tenant_id: str
    object_id: str
    policy: Policy
    due_at: datetime


@dataclass(frozen=True)
class RegistrationResult:
    """How many rows were new, had their due_at moved earlier, or stayed as they were."""

    inserted: int
    advanced: int
    unchanged: int


# One statement for the whole request (all-or-nothing). A second registration never
# postpones: due_at only moves earlier, and only while the item is still pending. Only the
# counts travel back, not a row per item.
_REGISTER = text("""
    WITH changed AS (
        INSERT INTO items AS i (tenant_id, object_id, policy, policy_version, operation_key,
                                scope, due_at)
        SELECT * FROM unnest(CAST(:tenants AS text[]), CAST(:objects AS text[]),
                             CAST(:policies AS text[]), CAST(:versions AS integer[]),
                             CAST(:keys AS text[]), CAST(:scopes AS text[]),
                             CAST(:dues AS timestamptz[]))
        ON CONFLICT (tenant_id, object_id, policy, policy_version) DO UPDATE
            SET due_at = EXCLUDED.due_at, updated_at = now()
            WHERE EXCLUDED.due_at < i.due_at AND i.status = 'pending'
        RETURNING (xmax = 0) AS inserted
    )
    SELECT count(*) FILTER (WHERE inserted) AS inserted, count(*) AS changed FROM changed
""")


async def register(engine: AsyncEngine, registrations: list[Registration]) -> RegistrationResult:
    """Register obligations idempotently in one transaction."""
    earliest: dict[tuple[str, str, str, int], Registration] = {}
    for reg in registrations:
        key = (reg.tenant_id, reg.object_id, reg.policy.name, reg.policy.version)
        kept = earliest.get(key)
        if kept is None or reg.due_at < kept.due_at:
            earliest[key] = reg
    rows = list(earliest.values())
    scopes = [r.policy.scope_for(r.tenant_id) for r in rows]
    params = {
        "tenants": [r.tenant_id for r in rows],
        "objects": [r.object_id for r in rows],
        "policies": [r.policy.name for r in rows],
        "versions": [r.policy.version for r in rows],
        "keys": [operation_key(r.tenant_id, r.object_id, r.policy.name, r.policy.version)
                 for r in rows],
        "scopes": scopes,
        "dues": [r.due_at for r in rows],
    }
    budgets = {scope: limiter.budget_of(r.policy) for scope, r in zip(scopes, rows, strict=True)}
    async with engine.begin() as conn:
        await limiter.ensure_scopes(conn, budgets)
        counts = (await conn.execute(_REGISTER, params)).one()
    inserted = int(counts.inserted)
    advanced = int(counts.changed) - inserted
    return RegistrationResult(inserted=inserted, advanced=advanced,
                              unchanged=len(registrations) - inserted - advanced)


@dataclass(frozen=True)
class ItemFilter:
    """Which items an operator means: explicit ids, or a filter over one status."""

    ids: list[int] | None = None
    operation_keys: list[str] | None = None
    policy: str | None = None
    tenant_id: str | None = None
    reason: str | None = None


_FILTER_SQL = """
      -- explicit ids and identities add up; the other fields narrow
      AND ((CAST(:ids AS bigint[]) IS NULL AND CAST(:keys AS text[]) IS NULL)
           OR id = ANY(CAST(:ids AS bigint[]))
           OR operation_key = ANY(CAST(:keys AS text[])))
      AND (CAST(:policy AS text) IS NULL OR policy = :policy)
      AND (CAST(:tenant AS text) IS NULL OR tenant_id = :tenant)
      AND (CAST(:reason AS text) IS NULL OR dead_reason = :reason OR last_error = :reason)
"""


def _filter_params(f: ItemFilter) -> dict[str, object]:
    return {"ids": f.ids, "keys": f.operation_keys, "policy": f.policy,
            "tenant": f.tenant_id, "reason": f.reason}


ITEM_COLUMNS = ("id, tenant_id, object_id, policy, policy_version, operation_key, scope, "
                "status, due_at, next_attempt_at, attempts, released_at, batch_id, "
                "last_outcome, last_status_code, last_error, dead_reason, created_at, "
                "updated_at, completed_at")


async def list_items(engine: AsyncEngine, *, status: str | None, item_filter: ItemFilter,
                     after: int | None, limit: int) -> list[dict[str, object]]:
    """Items by id (keyset pagination: pass the last id seen as `after`)."""
    sql = text(f"""
        SELECT {ITEM_COLUMNS} FROM items
        WHERE (CAST(:status AS text) IS NULL OR status = :status)
          AND (CAST(:after AS bigint) IS NULL OR id > :after)
          {_FILTER_SQL}
        ORDER BY id LIMIT :limit
    """)  # noqa: S608 - only constant fragments are interpolated
    params = {"status": status, "after": after, "limit": limit, **_filter_params(item_filter)}
    async with engine.connect() as conn:
        return [dict(r) for r in (await conn.execute(sql, params)).mappings()]


# Operator changes: bounded by :limit, each in one transaction together with its audit row.
_REDRIVE = text(f"""
    WITH chosen AS (
        SELECT id FROM items WHERE status = 'dead' {_FILTER_SQL}
        ORDER BY id LIMIT :limit FOR UPDATE SKIP LOCKED
    )
    UPDATE items i
    SET status = 'pending', attempts = 0, dead_reason = NULL, completed_at = NULL,
        next_attempt_at = now(), updated_at = now()
    FROM chosen WHERE i.id = chosen.id
    RETURNING i.id
""")  # noqa: S608 - only constant fragments are interpolated

_CANCEL = text(f"""
    WITH chosen AS (
        SELECT id FROM items WHERE status = 'pending' {_FILTER_SQL}
        ORDER BY id LIMIT :limit FOR UPDATE SKIP LOCKED
    )
    UPDATE items i
    SET status = 'cancelled', completed_at = now(), updated_at = now()
    FROM chosen WHERE i.id = chosen.id
    RETURNING i.id
""")  # noqa: S608 - only constant fragments are interpolated

async def redrive(engine: AsyncEngine, item_filter: ItemFilter, *, actor: str, reason: str,
                  limit: int) -> list[int]:
    """Dead items back to pending with their attempts reset (released items stay released,
    so workers take them at once); the audit trail records who and why."""
    return await _operator_change(engine, _REDRIVE, "redrive", item_filter, actor, reason, limit)


async def cancel(engine: AsyncEngine, item_filter: ItemFilter, *, actor: str, reason: str,
                 limit: int) -> list[int]:
    """Withdraw pending items (leased ones are in flight and cannot be withdrawn)."""
    return await _operator_change(engine, _CANCEL, "cancel", item_filter, actor, reason, limit)


async def _operator_change(engine: AsyncEngine, statement: TextClause, action: str,
                           item_filter: ItemFilter, actor: str, reason: str, limit: int
                           ) -> list[int]:
    async with engine.begin() as conn:
        ids = [int(r.id) for r in await conn.execute(
            statement, {**_filter_params(item_filter), "limit": limit})]
        details = {"filter": {k: v for k, v in asdict(item_filter).items() if v is not None},
                   "count": len(ids), "item_ids": ids[:1000]}
        await audit.record(conn, actor=actor, action=action, reason=reason, details=details)
    return ids

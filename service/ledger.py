"""Item registration and identity: the obligations Sweeper owes.

An item's operation key is a digest of exactly (tenant, object id, policy, policy version):
every attempt, from any worker, after any crash, sends the same key.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.policies import Policy

MAX_ID_BYTES = 512


def operation_key(tenant_id: str, object_id: str, policy: str, version: int) -> str:
    """Stable idempotency key; fields are length-prefixed so no two tuples collide."""
    h = hashlib.sha256()
    for part in (tenant_id, object_id, policy, str(version)):
        raw = part.encode("utf-8")
        h.update(len(raw).to_bytes(4, "big"))
        h.update(raw)
    return h.hexdigest()


def id_problem(value: str) -> str | None:
    """Why `value` cannot be a tenant or object id, or None when it can."""
    if not value:
        return "must not be empty"
    if len(value.encode("utf-8")) > MAX_ID_BYTES:
        return f"must be at most {MAX_ID_BYTES} bytes"
    if any(ord(c) < 32 or ord(c) == 127 or 0x80 <= ord(c) < 0xA0 for c in value):
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
# postpones: due_at only moves earlier, and only while the item is still pending.
_REGISTER = text("""
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
    params = {
        "tenants": [r.tenant_id for r in rows],
        "objects": [r.object_id for r in rows],
        "policies": [r.policy.name for r in rows],
        "versions": [r.policy.version for r in rows],
        "keys": [operation_key(r.tenant_id, r.object_id, r.policy.name, r.policy.version)
                 for r in rows],
        "scopes": [r.policy.scope_for(r.tenant_id) for r in rows],
        "dues": [r.due_at for r in rows],
    }
    async with engine.begin() as conn:
        result = await conn.execute(_REGISTER, params)
        changed = [bool(row.inserted) for row in result]
    inserted = sum(changed)
    advanced = len(changed) - inserted
    return RegistrationResult(inserted=inserted, advanced=advanced,
                              unchanged=len(registrations) - inserted - advanced)

"""Operator control of the rate budget: scope state, budgets changed at run time, pause and
resume per scope and for all workers. Every change is one transaction with its audit row,
and every replica obeys it from its next admission round (they read the rows each time)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service import audit
from service.limiter import tokens_at

# Scope state with the bucket's tokens as of now, and its eligible backlog.
_LIST = text(f"""
    SELECT s.name, s.rate_per_second, s.burst, s.weight, s.paused, s.paused_reason,
           s.closed_until, s.backoff_level, s.budget_from_policy, s.updated_at,
           {tokens_at('clock_timestamp()')} AS tokens,
           e.eligible, e.oldest_due_at,
           extract(epoch FROM now() - e.oldest_due_at)::double precision
               AS oldest_eligible_age_seconds
    FROM scopes s
    CROSS JOIN LATERAL (
        SELECT count(*) AS eligible, min(i.due_at) AS oldest_due_at FROM items i
        WHERE i.scope = s.name AND i.status = 'pending' AND i.released_at IS NOT NULL
    ) e
    WHERE (CAST(:after AS text) IS NULL OR s.name > :after)
      AND (CAST(:name AS text) IS NULL OR s.name = :name)
    ORDER BY s.name
    LIMIT :limit
""")  # noqa: S608 - only a constant fragment is interpolated


async def list_scopes(engine: AsyncEngine, *, after: str | None = None, name: str | None = None,
                      limit: int = 100) -> list[dict[str, Any]]:
    """Scopes by name (keyset pagination on the name)."""
    async with engine.connect() as conn:
        rows = await conn.execute(_LIST, {"after": after, "name": name, "limit": limit})
        return [dict(r) for r in rows.mappings()]


async def set_budget(engine: AsyncEngine, scope: str, *, rate: float, burst: int,
                     weight: int | None, actor: str, reason: str | None) -> bool:
    """Change a scope's budget now; policy reloads no longer overwrite it. False if the
    scope does not exist. Tokens never exceed the new burst."""
    async with engine.begin() as conn:
        row = (await conn.execute(text("""
            UPDATE scopes
            SET rate_per_second = CAST(:rate AS double precision),
                burst = CAST(:burst AS integer),
                weight = coalesce(CAST(:weight AS integer), weight),
                tokens = least(tokens, CAST(:burst AS double precision)),
                budget_from_policy = false, updated_at = now()
            WHERE name = :name RETURNING name
        """), {"rate": rate, "burst": burst, "weight": weight, "name": scope})).first()
        if row is None:
            return False
        await audit.record(conn, actor=actor, action="scope.budget", reason=reason,
                           details={"scope": scope, "rate_per_second": rate, "burst": burst,
                                    "weight": weight})
    return True


async def set_paused(engine: AsyncEngine, scope: str, *, paused: bool, actor: str,
                     reason: str | None) -> bool:
    """Pause (with a reason) or resume a scope; resuming also lifts a closure. False if the
    scope does not exist."""
    async with engine.begin() as conn:
        row = (await conn.execute(text("""
            UPDATE scopes
            SET paused = CAST(:paused AS boolean),
                paused_reason = CASE WHEN CAST(:paused AS boolean)
                                     THEN coalesce(CAST(:reason AS text), 'operator') END,
                closed_until = CASE WHEN CAST(:paused AS boolean) THEN closed_until END,
                backoff_level = CASE WHEN CAST(:paused AS boolean) THEN backoff_level ELSE 0 END,
                updated_at = now()
            WHERE name = :name RETURNING name
        """), {"paused": paused, "reason": reason, "name": scope})).first()
        if row is None:
            return False
        await audit.record(conn, actor=actor, reason=reason, details={"scope": scope},
                           action="scope.pause" if paused else "scope.resume")
    return True


async def set_workers_paused(engine: AsyncEngine, *, paused: bool, actor: str,
                             reason: str | None) -> None:
    """Stop (or restart) claiming on every replica. The row lock orders this against claims
    in progress; no claim admits work once the pause has committed."""
    async with engine.begin() as conn:
        # FOR UPDATE conflicts with the claims' FOR KEY SHARE: wait for those in progress
        await conn.execute(text("SELECT 1 FROM control FOR UPDATE"))
        await conn.execute(text(
            "UPDATE control SET workers_paused = CAST(:paused AS boolean), "
            "paused_reason = CASE WHEN CAST(:paused AS boolean) "
            "THEN coalesce(CAST(:reason AS text), 'operator') END, "
            "updated_at = now()"), {"paused": paused, "reason": reason})
        await audit.record(conn, actor=actor, reason=reason, details={},
                           action="workers.pause" if paused else "workers.resume")


async def workers_state(engine: AsyncEngine) -> dict[str, Any]:
    """Whether workers are paused everywhere, why, and since when."""
    async with engine.connect() as conn:
        row = (await conn.execute(text(
            "SELECT workers_paused, paused_reason, updated_at FROM control"))).mappings().one()
        return dict(row)

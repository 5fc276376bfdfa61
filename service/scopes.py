"""Operator control of the rate budget: scope state, budgets changed at run time, pause and
resume per scope and for all workers. Every change is one transaction with its audit row,
and every replica obeys it from its next admission round (they read the rows each time)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from service import audit
from service.db.statements import Statement, fetch, ready_item, run
from service.limiter import tokens_at

# `eligible` is the set sweeper_items_eligible counts (ready_item on the same clock), per
# scope, whether or not the scope is open: its backlog, not what its bucket lets through.
_LIST = Statement("scopes.list", (
    "Scopes by name with the bucket's tokens as of now and the ready items waiting in "
    "each."), f"""
    SELECT s.name, s.rate_per_second, s.burst, s.weight, s.paused, s.paused_reason,
           s.closed_until, s.backoff_level, s.budget_from_policy, s.updated_at,
           {tokens_at('clock_timestamp()')} AS tokens,
           e.eligible, e.oldest_due_at,
           extract(epoch FROM now() - e.oldest_due_at)::double precision
               AS oldest_eligible_age_seconds
    FROM scopes s
    CROSS JOIN LATERAL (
        SELECT count(*) AS eligible, min(i.due_at) AS oldest_due_at FROM items i
        WHERE i.scope = s.name AND {ready_item("now()")}
    ) e
    WHERE (CAST(:after AS text) IS NULL OR s.name > :after)
      AND (CAST(:name AS text) IS NULL OR s.name = :name)
    ORDER BY s.name
    LIMIT :limit
""")  # noqa: S608 - only constant fragments are interpolated


async def list_scopes(engine: AsyncEngine, *, after: str | None = None, name: str | None = None,
                      limit: int = 100) -> list[dict[str, Any]]:
    """Scopes by name (keyset pagination on the name)."""
    rows = await fetch(engine, _LIST, {"after": after, "name": name, "limit": limit})
    return [dict(r._mapping) for r in rows]


_SET_BUDGET = Statement("scopes.set_budget", (
    "An operator's budget for one scope; policy reloads leave it alone from then on."), """
    UPDATE scopes
    SET rate_per_second = CAST(:rate AS double precision),
        burst = CAST(:burst AS integer),
        weight = coalesce(CAST(:weight AS integer), weight),
        tokens = least(tokens, CAST(:burst AS double precision)),
        budget_from_policy = false, updated_at = now()
    WHERE name = :name RETURNING name
""")


async def set_budget(engine: AsyncEngine, scope: str, *, rate: float, burst: int,
                     weight: int | None, actor: str, reason: str | None) -> bool:
    """Change a scope's budget now; policy reloads no longer overwrite it. False if the
    scope does not exist. Tokens never exceed the new burst."""
    async with engine.begin() as conn:
        row = (await run(conn, _SET_BUDGET, {"rate": rate, "burst": burst, "weight": weight,
                                             "name": scope})).first()
        if row is None:
            return False
        await audit.record(conn, actor=actor, action="scope.budget", reason=reason,
                           details={"scope": scope, "rate_per_second": rate, "burst": burst,
                                    "weight": weight})
    return True


_SET_PAUSED = Statement("scopes.set_paused", (
    "An operator pauses one scope (with a reason) or resumes it, which also lifts a closure "
    "and its backoff."), """
    UPDATE scopes
    SET paused = CAST(:paused AS boolean),
        paused_reason = CASE WHEN CAST(:paused AS boolean)
                             THEN coalesce(CAST(:reason AS text), 'operator') END,
        closed_until = CASE WHEN CAST(:paused AS boolean) THEN closed_until END,
        backoff_level = CASE WHEN CAST(:paused AS boolean) THEN backoff_level ELSE 0 END,
        updated_at = now()
    WHERE name = :name RETURNING name
""")


async def set_paused(engine: AsyncEngine, scope: str, *, paused: bool, actor: str,
                     reason: str | None) -> bool:
    """Pause (with a reason) or resume a scope; resuming also lifts a closure. False if the
    scope does not exist."""
    async with engine.begin() as conn:
        row = (await run(conn, _SET_PAUSED, {"paused": paused, "reason": reason,
                                             "name": scope})).first()
        if row is None:
            return False
        await audit.record(conn, actor=actor, reason=reason, details={"scope": scope},
                           action="scope.pause" if paused else "scope.resume")
    return True


# FOR UPDATE conflicts with the admissions' FOR KEY SHARE of the row (limiter.GRANTS_SQL).
_LOCK_CONTROL = Statement("scopes.lock_control", (
    "Wait for admissions in progress before the workers-wide pause changes."),
    "SELECT 1 FROM control FOR UPDATE")
_SET_WORKERS_PAUSED = Statement("scopes.set_workers_paused", (
    "Stop or restart claiming on every replica (with a reason)."), """
    UPDATE control
    SET workers_paused = CAST(:paused AS boolean),
        paused_reason = CASE WHEN CAST(:paused AS boolean)
                             THEN coalesce(CAST(:reason AS text), 'operator') END,
        updated_at = now()
""")


async def set_workers_paused(engine: AsyncEngine, *, paused: bool, actor: str,
                             reason: str | None) -> None:
    """Stop (or restart) claiming on every replica. The row lock orders this against claims
    in progress; no claim admits work once the pause has committed."""
    async with engine.begin() as conn:
        await run(conn, _LOCK_CONTROL)
        await run(conn, _SET_WORKERS_PAUSED, {"paused": paused, "reason": reason})
        await audit.record(conn, actor=actor, reason=reason, details={},
                           action="workers.pause" if paused else "workers.resume")


_WORKERS_STATE = Statement("scopes.workers_state", (
    "Whether workers are paused everywhere, why, and since when."),
    "SELECT workers_paused, paused_reason, updated_at FROM control")


async def workers_state(engine: AsyncEngine) -> dict[str, Any]:
    """Whether workers are paused everywhere, why, and since when."""
    [row] = await fetch(engine, _WORKERS_STATE, {})
    return dict(row._mapping)

"""Operator control of the rate budget: scope state, budgets changed at run time, pause and
resume per scope and for all workers. Every change is one transaction with its audit row,
and every replica obeys it from its next admission round (they read the rows each time)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.budget.buckets import tokens_at
from service.db.statements import CLOSURE_OVER, Statement, fetch, ready_item, run
from service.db.wakeups import wake_workers
from service.evidence import audit_trail

# `eligible` is the set sweeper_items_eligible counts (ready_item on the same clock), per
# scope, whether or not the scope is open: its backlog, not what its bucket lets through.
_LIST = Statement("scope_controls.list", (
    "Scopes by name with the bucket's tokens as of now and the ready items waiting in "
    "each."), f"""
    SELECT s.name, s.rate_per_second, s.burst, s.weight, s.paused, s.paused_reason,
           s.closed_until, s.closed_reason, s.backoff_level, s.budget_from_policy,
           s.updated_at,
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


_SET_BUDGET = Statement("scope_controls.set_budget", (
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
        await audit_trail.record(conn, actor=actor, action="scope.budget", reason=reason,
                                 details={"scope": scope, "rate_per_second": rate, "burst": burst,
                                          "weight": weight})
    return True


_PAUSE = Statement("scope_controls.pause", (
    "An operator pauses one scope, with a reason; a closure and its backoff stay as they "
    "are."), """
    UPDATE scopes
    SET paused = true, paused_reason = coalesce(CAST(:reason AS text), 'operator'),
        updated_at = now()
    WHERE name = :name RETURNING name
""")


# The reasons answers pause scopes with: an operator's pause never takes one of them as it
# is (`no-credential` would be lifted by itself when the tenant's credential arrives).
RESERVED_REASONS = frozenset({"unauthorized", "no-credential"})


async def pause(engine: AsyncEngine, scope: str, *, actor: str, reason: str | None) -> bool:
    """Pause a scope (with a reason). False if the scope does not exist."""
    stored = f"operator: {reason}" if reason in RESERVED_REASONS else reason
    async with engine.begin() as conn:
        row = (await run(conn, _PAUSE, {"reason": stored, "name": scope})).first()
        if row is None:
            return False
        await audit_trail.record(conn, actor=actor, action="scope.pause", reason=reason,
                                 details={"scope": scope})
    return True


# A resume lifts a pause: the operator's, or `unauthorized` after a 401/403. A closure is
# the upstream's word (a 429's Retry-After, an exhausted RateLimit header, or the backoff
# after 429s without a date), so it stays unless the operator overrides it (`lift`): then
# the closure ends, the backoff resets, and the bucket refills from now, starting from the
# empty bucket the closure left (not from the end of the closure it no longer waits for).
# Returns the closure as it was (the end of one in force, else NULL: CLOSURE_OVER) and the
# backoff level, for the audit row.
_RESUME = Statement("scope_controls.resume", (
    "An operator resumes one scope, keeping an upstream closure unless told to lift it and "
    "its backoff; returns the closure as it was."), f"""
    WITH before AS (
        SELECT s.name, CASE WHEN NOT {CLOSURE_OVER} THEN s.closed_until END AS closed_until,
               s.backoff_level
        FROM scopes s WHERE s.name = :name FOR UPDATE
    )
    UPDATE scopes s
    SET paused = false, paused_reason = NULL,
        closed_until = CASE WHEN CAST(:lift AS boolean) THEN NULL ELSE s.closed_until END,
        backoff_level = CASE WHEN CAST(:lift AS boolean) THEN 0 ELSE s.backoff_level END,
        refilled_at = CASE WHEN CAST(:lift AS boolean)
                           THEN least(s.refilled_at, clock_timestamp()) ELSE s.refilled_at END,
        updated_at = now()
    FROM before WHERE s.name = before.name
    RETURNING s.name, before.closed_until, before.backoff_level
""")  # noqa: S608 - only a constant fragment is interpolated


async def resume(engine: AsyncEngine, scope: str, *, actor: str, reason: str | None,
                 lift_closure: bool = False) -> bool:
    """Resume a scope. An upstream closure and its backoff stay unless `lift_closure`
    (an operator overriding the upstream's Retry-After); the audit row records the choice
    and the closure as it was. False if the scope does not exist."""
    async with engine.begin() as conn:
        row = (await run(conn, _RESUME, {"lift": lift_closure, "name": scope})).first()
        if row is None:
            return False
        await wake_workers(conn)  # its items may be claimable now: sent at the commit
        closed_until = row.closed_until.isoformat() if row.closed_until else None
        await audit_trail.record(conn, actor=actor, action="scope.resume", reason=reason, details={
            "scope": scope, "lift_closure": lift_closure, "closed_until": closed_until,
            "backoff_level": row.backoff_level})
    return True


# -- pauses that end by themselves (service/worker/scope_resumption.py) ------------------

WAITING_PAGE: Final = 500

# Scopes paused for one reason, a page at a time after :after, each with one of its waiting
# items' tenant and policy (NULL when none waits any more): what the scope waits for is
# found from them (a tenant's credential, a policy's store). The items_ready index (scope
# first, pending, released, unheld) serves the lateral read.
_WAITING = Statement("scope_controls.waiting", (
    "Scopes paused for one reason, a page after a name, each with one waiting item's "
    "tenant and policy."), """
    SELECT s.name, i.tenant_id, i.policy
    FROM scopes s LEFT JOIN LATERAL (
        SELECT tenant_id, policy FROM items
        WHERE scope = s.name AND status = 'pending' AND released_at IS NOT NULL
          AND hold_id IS NULL
        LIMIT 1
    ) i ON true
    WHERE s.paused AND s.paused_reason = :reason AND s.name > :after
      AND (CAST(:tenant AS text) IS NULL OR i.tenant_id = CAST(:tenant AS text))
    ORDER BY s.name
    LIMIT :limit
""")

_RESUME_WAITING = Statement("scope_controls.resume_waiting", (
    "Resume scopes still paused for the reason they waited on (an operator's pause since "
    "stays)."), """
    UPDATE scopes SET paused = false, paused_reason = NULL, updated_at = now()
    WHERE name = ANY(CAST(:names AS text[])) AND paused AND paused_reason = :reason
    RETURNING name
""")


@dataclass(frozen=True)
class Waiting:
    """A scope paused for a reason that ends by itself, with one of its waiting items'
    tenant and policy (None when no item waits any more)."""

    name: str
    tenant_id: str | None
    policy: str | None


async def waiting(engine: AsyncEngine, reason: str, *, tenant_id: str | None = None
                  ) -> list[Waiting]:
    """Every scope paused for `reason` (only `tenant_id`'s, when given)."""
    found: list[Waiting] = []
    after = ""
    while True:
        rows = await fetch(engine, _WAITING, {"reason": reason, "after": after,
                                              "tenant": tenant_id, "limit": WAITING_PAGE})
        found.extend(Waiting(r.name, r.tenant_id, r.policy) for r in rows)
        if len(rows) < WAITING_PAGE:
            return found
        after = rows[-1].name


async def resume_waiting(engine: AsyncEngine, names: list[str], reason: str, *, actor: str,
                         why: str) -> list[str]:
    """Resume those of `names` still paused for `reason`, each with an audit row; returns
    them."""
    if not names:
        return []
    async with engine.begin() as conn:
        resumed = [r.name for r in await run(conn, _RESUME_WAITING,
                                             {"names": names, "reason": reason})]
        for scope in resumed:
            await audit_trail.record(conn, actor=actor, action="scope.resume", reason=why,
                                     details={"scope": scope, "paused_reason": reason})
        if resumed:
            await wake_workers(conn)
    return resumed


# FOR UPDATE conflicts with the admissions' FOR KEY SHARE of the row (buckets.GRANTS_SQL).
_LOCK_CONTROL = Statement("scope_controls.lock_control", (
    "Wait for admissions in progress before the workers-wide pause changes."),
    "SELECT 1 FROM control FOR UPDATE")
_SET_WORKERS_PAUSED = Statement("scope_controls.set_workers_paused", (
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
        await audit_trail.record(conn, actor=actor, reason=reason, details={},
                                 action="workers.pause" if paused else "workers.resume")
        if not paused:
            await wake_workers(conn)


_WORKERS_STATE = Statement("scope_controls.workers_state", (
    "Whether workers are paused everywhere, why, and since when."),
    "SELECT workers_paused, paused_reason, updated_at FROM control")


async def workers_state(engine: AsyncEngine) -> dict[str, Any]:
    """Whether workers are paused everywhere, why, and since when."""
    [row] = await fetch(engine, _WORKERS_STATE, {})
    return dict(row._mapping)

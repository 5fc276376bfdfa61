"""The shared rate budget's rows: one token bucket per scope in PostgreSQL, and the statements
that create, grant, close, adjust and pause them.

Every worker of every replica draws from the same row, so adding replicas never multiplies
the rate. The statements: which scopes have work and an open bucket (`eligible_scopes`), the
token half of the admission statement (`GRANTS_SQL`, composed by service.ledger.claims.admit,
which charges the bucket only for the items it claims, so unused tokens never leave it),
creating bucket rows from the policies (`ensure_scopes`), and what answers do to a scope
(`close`, `recovered`, `adjust`, `pause`, decided by service.budget.answer_effects). Bucket
times are the database's `clock_timestamp()` (not `now()`, the start of a transaction that
may have waited for the row lock), never a worker's clock.

Signals act on the scope: a 429 closes it until the retry time (`closed_until` only ever
moves later, plus a little jitter, never earlier); 429s without a date back off
exponentially per scope; 401/403 pause it with reason `unauthorized`. What "open" means is
`service.db.statements.OPEN_SCOPE`. The arithmetic these statements share with the worker
(lookahead, late tolerance, budgets in calls, jitter) is service.budget.rules; the
measurements behind the rules stated here are in bench/reports/design-notes.md ("The
budget").
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Final

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from service.budget.rules import LATE_TOLERANCE_MIN_S, Budget, Closure, jitter_for
from service.db.statements import (
    CLOSURE_OVER,
    IN_REGION,
    OPEN_SCOPE,
    UNPINNED,
    Database,
    Statement,
    fetch,
    fetch_none,
    ready_item,
    run,
)

# What a bucket may hold: its burst minus the tokens that can be spent late (up to
# late_tolerance after their moment, bunching with the ones after them), but at least one.
# A call spent late lands in the same second as the tokens due after it; with the whole
# burst in stock on top, a 1-second window at the upstream could hold rate + burst + rate x
# lateness. Keeping that allowance out of the stock bounds every window by rate + burst. It
# costs only refill that arrives while the bucket is nearly full, that is while no worker
# is asking.
SPENDABLE_BURST_SQL: Final = f"""greatest(1.0, s.burst - ceil(greatest(
        s.rate_per_second * {LATE_TOLERANCE_MIN_S}, 1.0)))"""


# Registration runs this in the transaction that inserts its items, so a row locked here
# stays locked for the whole insert. Only a row whose budget changes is locked (in name
# order: two registrations never deadlock), and an existing row is not even probed for a
# conflict: `ON CONFLICT DO UPDATE ... WHERE` locks the row whether its WHERE holds or not.
_ENSURE = Statement("buckets.ensure_scopes", (
    "Create missing bucket rows from the policies' budgets; a policy change reaches rows no "
    "operator has set (tokens never above the new burst)."), """
    WITH budget AS (
        SELECT * FROM unnest(CAST(:names AS text[]), CAST(:rates AS double precision[]),
                             CAST(:bursts AS integer[]), CAST(:per_call AS integer[]))
        AS b(name, rate, burst, per_call)
    ),
    stale AS (
        SELECT s.name, b.rate, b.burst, b.per_call, s.budget_from_policy AS from_policy
        FROM scopes s JOIN budget b ON b.name = s.name
        WHERE (s.budget_from_policy AND (s.rate_per_second, s.burst) <> (b.rate, b.burst))
           OR s.objects_per_call <> b.per_call
        ORDER BY s.name
        FOR NO KEY UPDATE OF s
    ),
    changed AS (
        -- an operator's budget stays; the objects a call carries are always the policy's
        UPDATE scopes s
        SET rate_per_second = CASE WHEN stale.from_policy THEN stale.rate
                                   ELSE s.rate_per_second END,
            burst = CASE WHEN stale.from_policy THEN stale.burst ELSE s.burst END,
            tokens = CASE WHEN stale.from_policy THEN least(s.tokens, stale.burst)
                          ELSE s.tokens END,
            objects_per_call = stale.per_call, updated_at = now()
        FROM stale WHERE s.name = stale.name
    )
    INSERT INTO scopes (name, rate_per_second, burst, tokens, objects_per_call)
    SELECT name, rate, burst, burst, per_call FROM budget b
    WHERE NOT EXISTS (SELECT 1 FROM scopes s WHERE s.name = b.name)
    ORDER BY name
    ON CONFLICT (name) DO NOTHING
""")


async def ensure_scopes(conn: AsyncConnection, budgets: Mapping[str, Budget]) -> None:
    """Make sure a bucket row exists for each scope (rate per second, burst, objects per
    call), inside the caller's transaction (registration creates the scopes of the items
    it writes)."""
    if not budgets:
        return
    names = sorted(budgets)
    await run(conn, _ENSURE, {"names": names,
                              "rates": [budgets[n][0] for n in names],
                              "bursts": [budgets[n][1] for n in names],
                              "per_call": [budgets[n][2] for n in names]})


# Work is a ready item (an expired lease is one); the workers-wide pause stops every scope. The
# probes are ordered LIMIT 1 subqueries so the planner walks the scope-leading partial
# indexes (an EXISTS may be planned as a scan of items, which grows with history); ready
# items are looked for after the scope's claim position first, as claims read them
# (claims.FRONT_SCAN_EVERY_S), and from the front only if none is there. Each half walks
# the scopes in name order and stops at its LIMIT: the probes run for the scopes read
# until enough have work, not for every scope (as a CTE read by both halves would:
# bench/reports/design-notes.md, "The budget").
_WITH_WORK: Final = f"""{OPEN_SCOPE}
          AND NOT (SELECT workers_paused FROM control)
          AND ((SELECT i.id FROM items i
                WHERE i.scope = s.name AND {ready_item("now()")} AND REGION
                  AND (coalesce(i.batch_id, 0), i.id) > (s.ready_after_batch,
                                                         s.ready_after_id)
                ORDER BY i.scope, coalesce(i.batch_id, 0), i.id LIMIT 1) IS NOT NULL
               OR (s.ready_after_id > 0 AND (SELECT i.id FROM items i
                   WHERE i.scope = s.name AND {ready_item("now()")} AND REGION
                   ORDER BY i.scope, coalesce(i.batch_id, 0), i.id LIMIT 1) IS NOT NULL))"""  # noqa: S608
_ELIGIBLE_SQL: Final = f"""
    (SELECT s.name, s.weight FROM scopes s WHERE s.name > :cursor AND {_WITH_WORK}
     ORDER BY s.name LIMIT :limit)
    UNION ALL
    (SELECT s.name, s.weight FROM scopes s WHERE s.name <= :cursor AND {_WITH_WORK}
     ORDER BY s.name LIMIT :limit)
"""  # noqa: S608 - only constant fragments are interpolated
_ELIGIBLE = Statement("buckets.eligible_scopes", (
    "Scopes with an open bucket and claimable work of tenants pinned to no region, "
    "round-robin after a cursor: where a worker's next admission asks for tokens."),
    _ELIGIBLE_SQL.replace("REGION", UNPINNED))
_ELIGIBLE_IN_REGION = Statement("buckets.eligible_scopes_in_region", (
    "Scopes with an open bucket and claimable work of one region's tenants, as "
    "buckets.eligible_scopes."), _ELIGIBLE_SQL.replace("REGION", IN_REGION))


async def eligible_scopes(db: Database, *, cursor: str, limit: int,
                          region: str | None = None) -> list[tuple[str, int]]:
    """Up to `limit` scopes with work of `region` (None: of tenants pinned nowhere),
    starting after `cursor` and wrapping around."""
    if region is None:
        rows = await fetch(db, _ELIGIBLE, {"cursor": cursor, "limit": limit})
    else:
        rows = await fetch(db, _ELIGIBLE_IN_REGION, {"cursor": cursor, "limit": limit,
                                                     "region": region})
    return [(r.name, int(r.weight)) for r in rows[:limit]]


def tokens_at(instant: str) -> str:
    """SQL for bucket row `s`'s tokens at `instant`: what it held at its last refill plus
    the refill since, capped at its spendable burst. (GET /v1/scopes shows the same.)"""
    return f"""least({SPENDABLE_BURST_SQL},
        s.tokens + s.rate_per_second * greatest(0.0, extract(epoch FROM
            {instant} - s.refilled_at)::double precision))"""


# CTEs `want` (from :names and :wants), `locked`, `bucket` and `grants` (scope, rate, at,
# avail, n, and the row's claim position), the token half of the admission statement
# (claims.admit): each scope's bucket locked in name order (concurrent admitters never
# deadlock) and refilled from the database clock as of `at`, and the whole tokens it grants
# now or within :lookahead (a reservation: the bucket goes below zero and the caller spends
# each token at its due time; without lending, every refill that completes while no worker
# is asking is lost to the burst cap). The caller writes `refilled_at = at` with
# `tokens = avail - spent`. Closed and paused scopes grant nothing, nor does any scope
# during a workers-wide pause (FOR KEY SHARE: the pause waits for grants in progress).
# `at` is read once per row, after its lock: the refill granted and the `refilled_at`
# recorded must be the same instant, or the refill in between is lost.
GRANTS_SQL: Final = f"""
    want AS (
        SELECT * FROM unnest(CAST(:names AS text[]), CAST(:wants AS integer[])) AS w(name, n)
    ),
    locked AS (
        SELECT s.name, w.n, s.rate_per_second, s.burst, s.tokens, s.refilled_at,
               s.ready_after_batch, s.ready_after_id, s.front_scanned_at, s.objects_per_call
        FROM scopes s JOIN want w ON w.name = s.name
        WHERE {OPEN_SCOPE}
          AND NOT (SELECT workers_paused FROM control FOR KEY SHARE)
        ORDER BY s.name
        FOR UPDATE OF s
    ),
    bucket AS MATERIALIZED (
        SELECT s.*, clock_timestamp() AS at FROM locked s
    ),
    grants AS (
        SELECT name AS scope, rate_per_second AS rate, at, avail, ready_after_batch,
               ready_after_id, front_scanned_at, objects_per_call AS per_call,
               greatest(0, least(n, floor(
                   avail + rate_per_second * CAST(:lookahead AS double precision))::integer)
               ) AS n
        FROM bucket s CROSS JOIN LATERAL (SELECT {tokens_at("s.at")} AS avail) t
    )"""  # noqa: S608 - only constant fragments are interpolated


# Close scopes after a 429 (or an exhausted RateLimit header). closed_until only moves
# later. With no delay from the upstream the scope's own backoff level sets it (and grows),
# never shorter than the policy's base (max_s >= base is validated): the floor that a 429
# without a usable Retry-After relies on.
# The bucket restarts empty at reopening, so the first call after it is not a burst.
_CLOSE = Statement("buckets.close", (
    "Close scopes after throttling signals: until the upstream's date, or by the scope's "
    "growing backoff (once per closure); closed_until only moves later."), f"""
    WITH c AS (
        SELECT * FROM unnest(CAST(:names AS text[]), CAST(:delays AS double precision[]),
                             CAST(:bases AS double precision[]),
                             CAST(:maxes AS double precision[]),
                             CAST(:jitters AS double precision[]),
                             CAST(:reasons AS text[]))
        AS c(name, delay, base, max_s, jitter, reason)
    ),
    locked AS (
        SELECT s.name, s.backoff_level, NOT {CLOSURE_OVER} AS in_force
        FROM scopes s JOIN c ON c.name = s.name
        ORDER BY s.name FOR UPDATE OF s
    ),
    target AS (
        SELECT l.name, c.reason, (c.delay IS NULL) AS from_backoff,
               -- a closure in force absorbs the dateless 429s of calls sent before it: a
               -- burst of them is one step of backoff, not one per call in flight
               (c.delay IS NULL AND l.in_force) AS absorbed,
               clock_timestamp() + make_interval(secs => coalesce(
                   c.delay, least(c.max_s, c.base * power(2.0, least(l.backoff_level, 60))))
                   * 1.0 + c.jitter) AS until
        FROM locked l JOIN c ON c.name = l.name
    )
    UPDATE scopes s
    SET closed_until = CASE WHEN t.absorbed THEN s.closed_until
                            ELSE greatest(coalesce(s.closed_until, '-infinity'), t.until) END,
        refilled_at = CASE WHEN t.absorbed THEN s.refilled_at
                           ELSE greatest(coalesce(s.closed_until, '-infinity'), t.until) END,
        tokens = 0,
        closed_reason = CASE WHEN t.absorbed THEN s.closed_reason ELSE t.reason END,
        backoff_level = CASE WHEN t.from_backoff AND NOT t.absorbed
                             THEN s.backoff_level + 1 ELSE s.backoff_level END,
        updated_at = now()
    FROM target t WHERE s.name = t.name
""")  # noqa: S608 - only a constant fragment is interpolated


async def close(engine: AsyncEngine, closures: Mapping[str, Closure],
                rng: random.Random | None = None) -> None:
    """Close scopes after throttling signals."""
    if not closures:
        return
    r = rng or random.Random()
    names = sorted(closures)
    cs = [closures[n] for n in names]
    await fetch_none(engine, _CLOSE, {
        "names": names, "delays": [c.delay_seconds for c in cs],
        "bases": [c.backoff_base_s for c in cs], "maxes": [c.backoff_max_s for c in cs],
        "jitters": [jitter_for(c.delay_seconds, c.backoff_base_s, r) for c in cs],
        "reasons": [c.reason for c in cs]})


_RECOVERED = Statement("buckets.recovered", (
    "Reset the 429 backoff of scopes that answered a success (rows already at 0 are not "
    "written)."), """
    UPDATE scopes SET backoff_level = 0
    WHERE name = ANY(CAST(:names AS text[])) AND backoff_level > 0
""")


async def recovered(engine: AsyncEngine, scopes: list[str]) -> None:
    """A success resets the scope's 429 backoff."""
    if scopes:
        await fetch_none(engine, _RECOVERED, {"names": sorted(scopes)})


# What answers say of a budget (answer_effects): a refund of the cost a call did not spend,
# and the upstream's view of what is left, which lowers the bucket when it knows better
# (another client of the same budget, or our estimate drifting). The bucket is refilled as
# of now first (tokens_at), then adjusted, never above its spendable burst nor below minus
# its burst. A closed scope is left alone: it restarts empty when it reopens.
_ADJUST = Statement("buckets.adjust", (
    "Refund unspent cost to buckets and lower them to what the upstream says is left."),
    f"""
    WITH a AS (
        SELECT * FROM unnest(CAST(:names AS text[]), CAST(:refunds AS double precision[]),
                             CAST(:caps AS double precision[])) AS a(name, refund, cap)
    ),
    locked AS (
        SELECT s.name, clock_timestamp() AS at, a.refund, a.cap
        FROM scopes s JOIN a ON a.name = s.name
        WHERE {CLOSURE_OVER}
        ORDER BY s.name FOR UPDATE OF s
    )
    UPDATE scopes s
    SET tokens = greatest(-s.burst::double precision, least(
                     coalesce(l.cap, 'Infinity'::double precision),
                     least({SPENDABLE_BURST_SQL}, {tokens_at("l.at")} + l.refund))),
        refilled_at = l.at,
        updated_at = now()
    FROM locked l WHERE s.name = l.name
""")  # noqa: S608 - only constant fragments are interpolated


async def adjust(engine: AsyncEngine, refunds: Mapping[str, float],
                 caps: Mapping[str, float]) -> None:
    """Apply refunds and caps (calls' worth of tokens) to buckets in one statement."""
    names = sorted(set(refunds) | set(caps))
    if names:
        await fetch_none(engine, _ADJUST, {
            "names": names, "refunds": [refunds.get(n, 0.0) for n in names],
            "caps": [caps.get(n) for n in names]})


_PAUSE = Statement("buckets.pause", (
    "Pause scopes after a credential fault (401/403), returning those that were running so "
    "each pause is signalled once."), """
    UPDATE scopes SET paused = true, paused_reason = :reason, updated_at = now()
    WHERE name = ANY(CAST(:names AS text[])) AND NOT paused
    RETURNING name
""")


async def pause(engine: AsyncEngine, scopes: list[str], reason: str) -> list[str]:
    """Pause scopes (e.g. `unauthorized`); returns those that were running."""
    if not scopes:
        return []
    rows = await fetch(engine, _PAUSE, {"names": sorted(scopes), "reason": reason})
    return [r.name for r in rows]


_DATABASE_TIME = Statement("buckets.database_time", (
    "The database's clock in Unix seconds, the clock every bucket and grant is on."), """
    SELECT extract(epoch FROM clock_timestamp())::double precision AS now
""")


async def database_time(engine: AsyncEngine) -> float:
    """The database's clock now, Unix seconds (to calibrate a worker's schedule)."""
    [row] = await fetch(engine, _DATABASE_TIME, {})
    return float(row.now)

"""Leases: the admission (tokens taken and items leased in one statement) and the hand-back
of leases never called, the worker's hot claim statements. What an attempt's outcome does to
its item is service/ledger/completions.py.

Which items a claim may take is `service.db.statements.ready_item` (an expired lease is one:
its worker died or stalled); the token half of the admission is
`service.budget.buckets.GRANTS_SQL`. Times come from the database clock only: the items are
read and leased as of the statement's transaction start (`now()`), the buckets refilled as
of their row locks (`clock_timestamp()`). Tests move that clock by moving the stored
instants (tests/integration/db_clock.py), or run the admission inside a transaction of their
own whose `now()` they read. The measurements behind the rules stated in comments here are
in bench/reports/design-notes.md ("Claims and completion").
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final

import asyncpg

from service.budget.buckets import GRANTS_SQL
from service.budget.rules import LOOKAHEAD_S, Grant
from service.db.statements import (
    IN_REGION,
    UNPINNED,
    Database,
    Statement,
    fetch_none,
    fetch_records,
    ready_item,
)
from service.values import value

# A claim reads a scope's released items from its claim position: after the last item its
# last claim took (scopes.ready_after_batch, ready_after_id). Claimed items leave their
# entries in items_ready until VACUUM, at the index's front, and a claim from the front
# walks them all, a walk that grows with the drain. Items come back behind the position
# (retries, hand-backs, webhook releases, a batch whose publication committed late, leases
# that ran out), so a claim reads from the front once this often, and whenever a claim
# found fewer items than its tokens (leases last tens of seconds, so one more second before
# a takeover changes little).
FRONT_SCAN_EVERY_S: Final = 1


@value
class Lease:
    """A claimed item: what the worker needs to call the upstream and to complete."""

    item_id: int
    tenant_id: str
    object_id: str
    policy: str
    policy_version: int
    operation_key: str
    scope: str
    lease_token: uuid.UUID
    attempt: int
    lease_expires_at: datetime
    reclaimed: bool = False  # the claim took over an expired lease
    object_version: str | None = None  # the version a conflict answer named, if any
    batch_id: int | None = None  # the batch that released it (None: a webhook released it)
    # its deletion answered success: this claim reads whether the object is gone instead
    confirming: bool = False
    # the W3C traceparent of the batch or webhook delivery that released it (tracing on)
    trace_parent: str | None = None


def _lease(r: asyncpg.Record) -> Lease:
    return Lease(r["id"], r["tenant_id"], r["object_id"], r["policy"], r["policy_version"],
                 r["operation_key"], r["scope"], r["lease_token"], r["attempts"],
                 r["lease_expires_at"], r["reclaimed"], r["object_version"], r["batch_id"],
                 r["confirming"], r["trace_parent"])


# What `ready` reads of each item it picks, whichever way it picks them (below).
_PICKED: Final = """i.id, coalesce(i.batch_id, 0) AS batch_key,
                   i.lease_token IS NOT NULL AS reclaimed,
                   i.attempts >= coalesce(
                       (SELECT m.n FROM attempt_limits m WHERE m.policy = i.policy),
                       2147483647) AS used_up"""

# The scope's claimable items of the claimer's region (REGION: UNPINNED or IN_REGION)
# from its claim position, in batch order (database mode).
_FROM_POSITION: Final = f"""
            SELECT {_PICKED}
            FROM items i
            WHERE i.scope = g.scope AND {ready_item("clock.now")} AND REGION
              AND (coalesce(i.batch_id, 0), i.id) > (g.after_batch, g.after_id)
            ORDER BY coalesce(i.batch_id, 0), i.id
            LIMIT g.n * g.per_call
            FOR UPDATE OF i SKIP LOCKED"""  # noqa: S608 - only constant fragments

# The same, of only the items a broker delivered (:only, by id, each with its scope in
# :only_scopes; broker mode): each scope probes its own ids by primary key; the scope's
# position is neither read nor needed.
_DELIVERED: Final = f"""
            SELECT {_PICKED}
            FROM unnest(CAST(:only AS bigint[]), CAST(:only_scopes AS text[]))
                 AS d(id, scope)
                 JOIN items i ON i.id = d.id
            WHERE d.scope = g.scope AND i.scope = g.scope
              AND {ready_item("clock.now")} AND {IN_REGION}
            ORDER BY i.id
            LIMIT g.n * g.per_call
            FOR UPDATE OF i SKIP LOCKED"""  # noqa: S608 - only constant fragments


# Admission in one statement: take tokens and claim at most that many items per scope.
#  1. `bucket`, `grants` (buckets.GRANTS_SQL): the scopes' rows locked in name order
#     (concurrent admitters never deadlock) and refilled from the database clock; whole
#     tokens available now or within the lookahead, at most what was asked. Closed and
#     paused scopes, and every scope during a workers-wide pause (FOR KEY SHARE: a pause
#     waits for admissions in progress), grant nothing.
#  2. `starts`: each scope's claim position (see FRONT_SCAN_EVERY_S), a range condition on
#     items_ready.
#  3. `ready`, per scope (LATERAL): claimable items in batch order (webhook releases, batch
#     key 0, first) via the scope-leading partial index items_ready, which holds leased
#     items too: a lease that ran out is claimable (its worker died or stalled), one that
#     runs is not. SKIP LOCKED so concurrent claimers take disjoint rows, and the LIMIT sits
#     inside the subquery so it bounds the rows locked. A row another claim leased after
#     this statement's snapshot is re-checked under its lock, and skipped. In broker mode
#     (claims.admit_delivered) the same, of the delivered ids alone, by primary key.
#  4. `exhausted`: a lease that ran out on an item that has used up its policy's attempts
#     is not leased again: its worker died or stalled on the last allowed attempt (an item
#     that crashes every worker that calls it would otherwise loop forever), so it goes
#     `dead`.
#  5. `claimed`: a fresh lease token and an expiry from the database clock (lease length
#     per policy), the attempt counted, and what the worker needs returned. The item stays
#     `pending` and no column an index reads changes, so the update can be HOT (migration
#     0024): the claim writes no index entry.
#  6. `spent`: the bucket is charged only for the items actually claimed, so unused tokens
#     never leave it. The row also records where the scope's next claim reads from: after
#     the last item this one read, or the front (0, 0) once a claim found fewer items than
#     its tokens.
# A token is one call: of one item, or of up to `objects_per_call` items for a scope whose
# policy sends many per call (3 takes that many items per token, 6 charges a token per
# started group of them; the worker sends each group as one call).
# One row per lease with its scope's grant, plus one row (id NULL) per scope that was
# granted tokens but got no item, or was granted none (with the wait for its next token).
# (`ready` reads a scope's items by PICK: _FROM_POSITION or _DELIVERED)
_ADMISSION: Final = f"""
    WITH clock AS (SELECT now() AS now),  -- one instant to read and lease the items at
    {GRANTS_SQL},
    starts AS (
        SELECT g.scope, g.n, g.per_call, p.front,
               CASE WHEN p.front THEN 0 ELSE g.ready_after_batch END AS after_batch,
               CASE WHEN p.front THEN 0 ELSE g.ready_after_id END AS after_id
        FROM grants g, clock CROSS JOIN LATERAL (
            SELECT g.ready_after_id = 0 OR g.front_scanned_at IS NULL
                   OR g.front_scanned_at <= clock.now - interval '{FRONT_SCAN_EVERY_S} s'
                   AS front
        ) p
    ),
    attempt_limits AS (
        SELECT * FROM unnest(CAST(:limit_policies AS text[]),
                             CAST(:limit_attempts AS integer[])) AS m(policy, n)
    ),
    ready AS (
        SELECT r.id, r.batch_key, g.scope, r.reclaimed, r.reclaimed AND r.used_up AS exhausted
        FROM starts g, clock CROSS JOIN LATERAL (PICK
        ) r
        WHERE g.n > 0
    ),
    exhausted AS (
        UPDATE items i
        SET status = 'dead', lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL,
            last_outcome = 'unknown', last_status_code = NULL, last_error = 'lease_expired',
            dead_reason = 'max_attempts:lease_expired', completed_at = clock.now,
            updated_at = clock.now
        FROM ready x, clock
        WHERE i.id = x.id AND x.exhausted
    ),
    lease_lengths AS (
        SELECT * FROM unnest(CAST(:policy_names AS text[]),
                             CAST(:lease_seconds AS integer[])) AS l(policy, seconds)
    ),
    claimed AS (
        UPDATE items i
        SET lease_owner = :owner,
            lease_token = gen_random_uuid(),
            lease_expires_at = clock.now + make_interval(secs => coalesce(
                (SELECT l.seconds FROM lease_lengths l WHERE l.policy = i.policy),
                :default_lease)),
            attempts = i.attempts + 1,
            updated_at = clock.now
        FROM ready picked, clock
        WHERE i.id = picked.id AND NOT picked.exhausted
        RETURNING i.id, i.tenant_id, i.object_id, i.policy, i.policy_version,
                  i.operation_key, i.scope, i.lease_token, i.attempts, i.lease_expires_at,
                  i.object_version, i.batch_id, i.confirming, picked.reclaimed,
                  i.trace_parent
    ),
    used AS (SELECT scope, count(*)::integer AS n FROM claimed GROUP BY scope),
    reached AS (
        SELECT DISTINCT ON (scope) scope, batch_key, id FROM ready
        ORDER BY scope, batch_key DESC, id DESC
    ),
    spent AS (
        UPDATE scopes s
        -- a token is a call of up to per_call items (1 but for batch policies)
        SET tokens = g.avail - ceil(coalesce(u.n, 0)::double precision / g.per_call),
            refilled_at = g.at,
            -- a scope granted nothing read nothing: its position stands
            (ready_after_batch, ready_after_id) = (
                CASE WHEN g.n = 0 THEN s.ready_after_batch
                     WHEN coalesce(u.n, 0) < g.n * g.per_call THEN 0
                     ELSE coalesce(r.batch_key, st.after_batch) END,
                CASE WHEN g.n = 0 THEN s.ready_after_id
                     WHEN coalesce(u.n, 0) < g.n * g.per_call THEN 0
                     ELSE coalesce(r.id, st.after_id) END),
            front_scanned_at = CASE WHEN g.n > 0 AND st.front THEN clock.now
                                    ELSE s.front_scanned_at END
        FROM grants g JOIN starts st ON st.scope = g.scope
             LEFT JOIN used u ON u.scope = g.scope
             LEFT JOIN reached r ON r.scope = g.scope, clock
        WHERE s.name = g.scope
        RETURNING s.name, g.n AS granted, coalesce(u.n, 0) AS used, g.avail, g.rate,
                  g.per_call,
                  extract(epoch FROM g.at)::double precision AS granted_at,
                  greatest(0.0, (1.0 - (g.avail - g.n)) / g.rate
                                - CAST(:lookahead AS double precision)) AS wait_seconds
    )
    SELECT sp.name AS grant_scope, sp.granted, sp.used, sp.avail, sp.rate, sp.granted_at,
           sp.per_call,
           -- the claim's end (its rows are locked and leased by now): see Grant.claimed_at
           extract(epoch FROM clock_timestamp())::double precision AS claimed_at,
           sp.wait_seconds, c.*
    FROM spent sp LEFT JOIN claimed c ON c.scope = sp.name
"""  # noqa: S608 - only constant fragments are interpolated


_ADMIT = Statement("claims.admit", (
    "Take tokens and lease at most that many calls' worth of claimable items per scope in "
    "one statement, charging each bucket only for the calls the items leased make; items "
    "of tenants pinned to no region only."),
    _ADMISSION.replace("PICK", _FROM_POSITION.replace("REGION", UNPINNED)))
_ADMIT_IN_REGION = Statement("claims.admit_in_region", (
    "Take tokens and lease claimable items as claims.admit does, of one region's tenants."),
    _ADMISSION.replace("PICK", _FROM_POSITION.replace("REGION", IN_REGION)))
_ADMIT_DELIVERED = Statement("claims.admit_delivered", (
    "Take tokens and lease at most that many calls' worth of the claimable items among "
    "those a broker delivered, per scope, as claims.admit does."),
    _ADMISSION.replace("PICK", _DELIVERED))


@dataclass(frozen=True)
class Admission:
    """What one admission statement took: tokens per scope (a scope missing was closed or
    paused), and the leases claimed with them (at most `granted` per scope)."""

    grants: list[Grant]
    leases: list[Lease]

    @property
    def reclaimed(self) -> int:
        return sum(1 for lease in self.leases if lease.reclaimed)


async def admit(db: Database, *, owner: str, wants: Mapping[str, int],
                lease_seconds: Mapping[str, int], default_lease_seconds: int = 60,
                max_attempts: Mapping[str, int] | None = None,
                lookahead_s: float = LOOKAHEAD_S,
                only: Sequence[tuple[int, str]] | None = None,
                region: str | None = None) -> Admission:
    """Take up to wants[scope] tokens per scope and lease at most that many items of each
    for `owner`, charging the buckets only for the items leased; committed on return. An
    expired lease of an item with `max_attempts[policy]` attempts used goes `dead`. With
    `only` (broker mode: (item id, its scope) pairs), the items are leased from among
    those alone. Only items of `region` are leased (None: of tenants pinned nowhere)."""
    wanted = {scope: n for scope, n in wants.items() if n > 0}
    if not wanted:
        return Admission(grants=[], leases=[])
    names = sorted(wanted)
    statement = (_ADMIT_DELIVERED if only is not None else
                 _ADMIT if region is None else _ADMIT_IN_REGION)
    rows = await fetch_records(db, statement, {
        **({} if only is None else {"only": [i for i, _ in only],
                                    "only_scopes": [scope for _, scope in only]}),
        **({} if statement is _ADMIT else {"region": region}),
        "names": names, "wants": [wanted[n] for n in names], "owner": owner,
        "lookahead": lookahead_s, "policy_names": list(lease_seconds),
        "lease_seconds": list(lease_seconds.values()), "default_lease": default_lease_seconds,
        "limit_policies": list(max_attempts or {}),
        "limit_attempts": list((max_attempts or {}).values())})
    grants: dict[str, Grant] = {}
    leases: list[Lease] = []
    for r in rows:
        scope = r["grant_scope"]
        if scope not in grants:
            grants[scope] = Grant(scope, int(r["granted"]), float(r["wait_seconds"]),
                                  float(r["avail"]), float(r["rate"]), float(r["granted_at"]),
                                  int(r["per_call"]), float(r["claimed_at"]))
        if r["id"] is not None:
            leases.append(_lease(r))
    return Admission(grants=list(grants.values()), leases=leases)


# Hand back leases that were claimed but never called, and their tokens, in one statement:
# fenced on the token like a completion, the attempt is refunded and the item is claimable
# again; every lease's token goes back to its scope's bucket (capped at the burst; no call
# spent it, whether or not the lease had moved on), the bucket rows locked in name order
# like every other bucket update.
_HAND_BACK = Statement("claims.hand_back", (
    "Return unstarted leases without counting an attempt, and their tokens to the buckets."),
    """
    WITH r AS (
        SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:tokens AS uuid[]),
                             CAST(:scopes AS text[]), CAST(:calls AS integer[]))
        AS r(id, token, scope, calls)
    ),
    released AS (
        UPDATE items i
        SET lease_owner = NULL, lease_token = NULL,
            lease_expires_at = NULL, attempts = greatest(i.attempts - 1, 0),
            updated_at = now()
        FROM r
        WHERE i.id = r.id AND i.lease_token = r.token
        RETURNING i.id
    ),
    back AS (SELECT scope AS name, sum(calls)::integer AS n FROM r GROUP BY scope),
    locked AS (
        SELECT s.name FROM scopes s JOIN back b ON b.name = s.name
        ORDER BY s.name FOR UPDATE OF s
    )
    UPDATE scopes s SET tokens = least(s.burst::double precision, s.tokens + b.n)
    FROM back b JOIN locked l ON l.name = b.name
    WHERE s.name = b.name
""")


async def hand_back(db: Database, leases: Sequence[Lease],
                    tokens: Sequence[int] | None = None) -> None:
    """Return unstarted leases without counting an attempt, and give back their tokens:
    `tokens[i]` for lease i (default 1 each; a batch's call returns its one token with its
    first lease)."""
    if leases:
        await fetch_none(db, _HAND_BACK, {"ids": [x.item_id for x in leases],
                                          "tokens": [x.lease_token for x in leases],
                                          "scopes": [x.scope for x in leases],
                                          "calls": list(tokens or [1] * len(leases))})

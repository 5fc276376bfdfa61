"""Leases: admission (tokens and claim in one statement), fenced completion, and
hand-back of unstarted leases: the worker's hot statements.

Which items a claim may take is `service.db.statements.ready_item` and `expired_lease`;
the token half of the admission is `service.budget.buckets.GRANTS_SQL`. Times come from the database
clock. `admit(now=...)` pins the clock the items are read and leased on (the bucket keeps
the database's own); tests move the buckets' clock by moving their stored instants
(tests/integration/db_clock.py). The measurements behind the rules stated in comments here
are in bench/reports/design-notes.md.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy import Row

from service.budget.buckets import GRANTS_SQL
from service.budget.rules import LOOKAHEAD_S, Grant
from service.db.statements import (
    Database,
    Statement,
    expired_lease,
    fetch,
    fetch_none,
    ready_item,
)
from service.evidence.deletion_records import canonical_sql

# A claim reads a scope's released items from its claim position: after the last item its
# last claim took (scopes.ready_after_batch, ready_after_id). Claimed items leave their
# entries in items_ready until VACUUM, at the index's front, and a claim from the front
# walks them all, a walk that grows with the drain. Items come back behind the position
# (retries, hand-backs, webhook releases, a batch whose publication committed late), so a
# claim reads from the front once this often, and whenever a claim found fewer items than
# its tokens. Expired leases are looked for on those front reads only (items_leased has the
# same walk; leases last tens of seconds, so one more second before a takeover changes
# little).
FRONT_SCAN_EVERY_S: Final = 1


@dataclass(frozen=True)
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


def _lease(r: Row[Any]) -> Lease:
    return Lease(r.id, r.tenant_id, r.object_id, r.policy, r.policy_version, r.operation_key,
                 r.scope, r.lease_token, r.attempts, r.lease_expires_at, r.reclaimed,
                 r.object_version, r.batch_id, r.confirming)


# Admission in one statement: take tokens and claim at most that many items per scope.
#  1. `bucket`, `grants` (buckets.GRANTS_SQL): the scopes' rows locked in name order
#     (concurrent admitters never deadlock) and refilled from the database clock; whole
#     tokens available now or within the lookahead, at most what was asked. Closed and
#     paused scopes, and every scope during a workers-wide pause (FOR KEY SHARE: a pause
#     waits for admissions in progress), grant nothing.
#  2. `starts`: each scope's claim position (see FRONT_SCAN_EVERY_S), a range condition on
#     items_ready; expired leases are looked for only when reading from the front.
#  3. per scope (LATERAL): its expired leases first (their worker died or stalled), then
#     released pending items whose next attempt is due, in batch order (webhook releases,
#     batch key 0, first) via the scope-leading partial indexes; SKIP LOCKED so concurrent
#     claimers take disjoint rows, and each LIMIT sits inside its subquery so it bounds the
#     rows locked.
#  4. `exhausted`: an expired lease whose item has used up its policy's attempts is not
#     leased again: its worker died or stalled on the last allowed attempt (an item that
#     crashes every worker that calls it would otherwise loop forever), so it goes `dead`.
#  5. `claimed`: a fresh lease token and an expiry from the database clock (lease length
#     per policy), the attempt counted, and what the worker needs returned.
#  6. `spent`: the bucket is charged only for the items actually claimed, so unused tokens
#     never leave it. The row also records where the scope's next claim reads from: after
#     the last pending item this one took, or the front (0, 0) once a claim found fewer
#     items than its tokens.
# A token is one call: of one item, or of up to `objects_per_call` items for a scope whose
# policy sends many per call (3 takes that many items per token, 6 charges a token per
# started group of them; the worker sends each group as one call).
# One row per lease with its scope's grant, plus one row (id NULL) per scope that was
# granted tokens but got no item, or was granted none (with the wait for its next token).
_ADMIT = Statement("claims.admit", (
    "Take tokens and lease at most that many calls' worth of claimable items per scope in "
    "one statement, charging each bucket only for the calls the items leased make."), f"""
    WITH clock AS (SELECT coalesce(CAST(:now AS timestamptz), now()) AS now),
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
    expired AS (
        SELECT e.id, g.scope, e.exhausted FROM starts g, clock CROSS JOIN LATERAL (
            SELECT i.id, i.attempts >= coalesce(
                       (SELECT m.n FROM attempt_limits m WHERE m.policy = i.policy),
                       2147483647) AS exhausted
            FROM items i
            WHERE i.scope = g.scope AND {expired_lease("clock.now")}
            ORDER BY i.lease_expires_at
            LIMIT g.n * g.per_call
            FOR UPDATE OF i SKIP LOCKED
        ) e
        WHERE g.n > 0 AND g.front
    ),
    exhausted AS (
        UPDATE items i
        SET status = 'dead', lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL,
            last_outcome = 'unknown', last_status_code = NULL, last_error = 'lease_expired',
            dead_reason = 'max_attempts:lease_expired', completed_at = clock.now,
            updated_at = clock.now
        FROM expired x, clock
        WHERE i.id = x.id AND x.exhausted
    ),
    ready AS (
        SELECT r.id, r.batch_key, g.scope FROM starts g, clock CROSS JOIN LATERAL (
            SELECT i.id, coalesce(i.batch_id, 0) AS batch_key FROM items i
            WHERE i.scope = g.scope AND {ready_item("clock.now")}
              AND (coalesce(i.batch_id, 0), i.id) > (g.after_batch, g.after_id)
            ORDER BY coalesce(i.batch_id, 0), i.id
            LIMIT g.n * g.per_call - (SELECT count(*) FROM expired x
                                      WHERE x.scope = g.scope AND NOT x.exhausted)
            FOR UPDATE OF i SKIP LOCKED
        ) r
        WHERE g.n > 0
    ),
    picked AS (SELECT id FROM expired WHERE NOT exhausted UNION ALL SELECT id FROM ready),
    lease_lengths AS (
        SELECT * FROM unnest(CAST(:policy_names AS text[]),
                             CAST(:lease_seconds AS integer[])) AS l(policy, seconds)
    ),
    claimed AS (
        UPDATE items i
        SET status = 'leased',
            lease_owner = :owner,
            lease_token = gen_random_uuid(),
            lease_expires_at = clock.now + make_interval(secs => coalesce(
                (SELECT l.seconds FROM lease_lengths l WHERE l.policy = i.policy),
                :default_lease)),
            attempts = i.attempts + 1,
            updated_at = clock.now
        FROM picked, clock
        WHERE i.id = picked.id
        RETURNING i.id, i.tenant_id, i.object_id, i.policy, i.policy_version,
                  i.operation_key, i.scope, i.lease_token, i.attempts, i.lease_expires_at,
                  i.object_version, i.batch_id, i.confirming,
                  EXISTS (SELECT 1 FROM expired WHERE expired.id = i.id) AS reclaimed
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
""")  # noqa: S608 - only constant fragments are interpolated


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
                lookahead_s: float = LOOKAHEAD_S, now: datetime | None = None) -> Admission:
    """Take up to wants[scope] tokens per scope and lease at most that many items of each
    for `owner`, charging the buckets only for the items leased; committed on return. An
    expired lease of an item with `max_attempts[policy]` attempts used goes `dead`."""
    wanted = {scope: n for scope, n in wants.items() if n > 0}
    if not wanted:
        return Admission(grants=[], leases=[])
    names = sorted(wanted)
    rows = await fetch(db, _ADMIT, {
        "now": now, "names": names, "wants": [wanted[n] for n in names], "owner": owner,
        "lookahead": lookahead_s, "policy_names": list(lease_seconds),
        "lease_seconds": list(lease_seconds.values()), "default_lease": default_lease_seconds,
        "limit_policies": list(max_attempts or {}),
        "limit_attempts": list((max_attempts or {}).values())})
    grants: dict[str, Grant] = {}
    leases: list[Lease] = []
    for r in rows:
        if r.grant_scope not in grants:
            grants[r.grant_scope] = Grant(r.grant_scope, int(r.granted),
                                          float(r.wait_seconds), float(r.avail),
                                          float(r.rate), float(r.granted_at),
                                          int(r.per_call), float(r.claimed_at))
        if r.id is not None:
            leases.append(_lease(r))
    return Admission(grants=list(grants.values()), leases=leases)


@dataclass(frozen=True)
class Completion:
    """The outcome of one attempt, as the ledger applies it.

    `status` is the item's next status (pending, succeeded, dead, skipped); `retry_in_seconds` sets
    next_attempt_at from the database clock for pending; `refund_attempt` gives the attempt
    back (throttled, unauthorized: not the item's fault). `to_confirm`: pending, its next
    claim makes the policy's confirmation read, not the deletion; `confirmed`: succeeded
    because that read found the object gone (the evidence record says so)."""

    lease: Lease
    worker: str
    outcome: str
    status: str
    reason: str
    http_status: int | None
    retry_after_seconds: float | None
    retry_in_seconds: float
    refund_attempt: bool
    started_at: datetime
    finished_at: datetime
    latency_ms: float
    object_version: str | None = None  # a conflict's current version: the next call's
    to_confirm: bool = False
    confirmed: bool = False


# Fenced completion, for a whole set of attempts in one statement:
#  1. `done`: the outcomes as rows.
#  2. `applied`: update only items still leased under the same token. A worker whose lease
#     expired and was re-claimed elsewhere matches nothing here: it changes nothing. Every
#     outcome sets `confirming`: whether the item's next claim reads rather than deletes.
#  3. `deleted` .. `moved`: the items that succeeded are appended to the evidence log as
#     one segment (service/evidence/chain.py), chained as it is written: `head` locks the
#     log's one head row only after every item above is updated (the count reads `applied`
#     to its end), so a completion never holds the head while it waits for an item's row
#     lock, and holds it until its commit; the segment stores each entry's canonical bytes
#     and the chain after it.
#  4. every attempt is appended to the audit trail, fenced ones flagged as such.
_COMPLETE = Statement("claims.complete", (
    "Apply attempts' outcomes to items still leased under the same token, append each "
    "deletion to the evidence log chained, and append every attempt, fenced ones "
    "flagged."), f"""
    WITH done AS (
        SELECT * FROM unnest(
            CAST(:ids AS bigint[]), CAST(:tokens AS uuid[]), CAST(:statuses AS text[]),
            CAST(:outcomes AS text[]), CAST(:reasons AS text[]), CAST(:http AS smallint[]),
            CAST(:retry_after AS double precision[]), CAST(:retry_in AS double precision[]),
            CAST(:refund AS boolean[]), CAST(:attempt_nos AS integer[]),
            CAST(:workers AS text[]), CAST(:started AS timestamptz[]),
            CAST(:finished AS timestamptz[]), CAST(:latency AS double precision[]),
            CAST(:versions AS text[]), CAST(:to_confirm AS boolean[]),
            CAST(:confirmed AS boolean[]))
        AS d(id, token, status, outcome, reason, http, retry_after, retry_in, refund,
             attempt_no, worker, started_at, finished_at, latency_ms, object_version,
             to_confirm, confirmed)
    ),
    applied AS (
        UPDATE items i
        SET status = d.status,
            lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL,
            attempts = CASE WHEN d.refund THEN greatest(i.attempts - 1, 0) ELSE i.attempts END,
            next_attempt_at = CASE WHEN d.status = 'pending'
                                   THEN now() + make_interval(secs => d.retry_in)
                                   ELSE i.next_attempt_at END,
            last_outcome = d.outcome,
            last_status_code = d.http,
            last_error = CASE WHEN d.outcome = 'succeeded' THEN NULL ELSE d.reason END,
            dead_reason = CASE WHEN d.status = 'dead' THEN d.reason END,
            completed_at = CASE WHEN d.status IN ('succeeded', 'dead', 'skipped') THEN now()
                           END,
            object_version = coalesce(d.object_version, i.object_version),
            confirming = d.to_confirm,
            updated_at = now()
        FROM done d
        -- the token alone fences: only leased rows carry one (CHECK items_lease), and
        -- without a status filter the planner keeps to primary-key lookups
        WHERE i.id = d.id AND i.lease_token = d.token
        RETURNING i.id, i.status, i.tenant_id, i.object_id, i.policy, i.policy_version,
                  i.operation_key, i.last_outcome, i.last_status_code, i.attempts,
                  i.completed_at, i.batch_id, d.confirmed
    ),
    deleted AS (
        SELECT a.id AS item_id, b.run_id,
               CASE WHEN a.batch_id IS NULL THEN 'webhook' ELSE 'run' END AS released_by,
               a.tenant_id, a.object_id, a.policy, a.policy_version, a.operation_key,
               a.last_outcome AS outcome, a.last_status_code AS upstream_status, a.attempts,
               a.completed_at, a.confirmed
        FROM applied a LEFT JOIN batches b ON b.id = a.batch_id
        WHERE a.status = 'succeeded'
    ),
    canonical AS (
        SELECT d.item_id, d.run_id, {canonical_sql("d")} AS bytes FROM deleted d
    ),
    head AS (
        SELECT h.size, h.hash FROM evidence_log_head h
        WHERE h.id = 1 AND (SELECT count(*) FROM canonical) > 0
        FOR UPDATE
    ),
    segment AS (
        SELECT head.size + 1 AS seq_start, head.size + count(*) AS seq_end,
               coalesce(array_agg(DISTINCT c.run_id) FILTER (WHERE c.run_id IS NOT NULL),
                        '{{}}') AS runs,
               string_agg(int4send(octet_length(c.bytes)) || c.bytes, ''::bytea
                          ORDER BY c.item_id) AS records,
               sha256(head.hash || string_agg(sha256(c.bytes), ''::bytea
                                              ORDER BY c.item_id)) AS hash
        FROM canonical c, head
        GROUP BY head.size, head.hash
    ),
    logged AS (
        INSERT INTO evidence_log (seq_end, seq_start, runs, records, hash)
        SELECT seq_end, seq_start, runs, records, hash FROM segment
    ),
    moved AS (
        UPDATE evidence_log_head h SET size = s.seq_end, hash = s.hash
        FROM segment s WHERE h.id = 1
    )
    INSERT INTO attempts (item_id, attempt_no, worker, lease_token, started_at, finished_at,
                          outcome, http_status, retry_after_seconds, latency_ms, error_code,
                          fenced)
    SELECT d.id, d.attempt_no, d.worker, d.token, d.started_at,
           greatest(d.finished_at, d.started_at), d.outcome, d.http, d.retry_after,
           d.latency_ms, CASE WHEN d.outcome = 'succeeded' THEN NULL ELSE d.reason END,
           d.id NOT IN (SELECT id FROM applied)
    FROM done d
    RETURNING item_id, fenced
""")  # noqa: S608 - only constant fragments are interpolated


async def complete(db: Database, completions: Sequence[Completion]) -> list[int]:
    """Apply outcomes and append attempts in one statement; returns the ids that were
    fenced out (their lease had moved on)."""
    if not completions:
        return []
    c = completions
    params = {
        "ids": [x.lease.item_id for x in c], "tokens": [x.lease.lease_token for x in c],
        "statuses": [x.status for x in c], "outcomes": [x.outcome for x in c],
        "reasons": [x.reason for x in c], "http": [x.http_status for x in c],
        "retry_after": [x.retry_after_seconds for x in c],
        "retry_in": [x.retry_in_seconds for x in c], "refund": [x.refund_attempt for x in c],
        "attempt_nos": [x.lease.attempt for x in c], "workers": [x.worker for x in c],
        "started": [x.started_at for x in c], "finished": [x.finished_at for x in c],
        "latency": [x.latency_ms for x in c],
        "versions": [x.object_version for x in c],
        "to_confirm": [x.to_confirm for x in c], "confirmed": [x.confirmed for x in c],
    }
    rows = await fetch(db, _COMPLETE, params)
    return [r.item_id for r in rows if r.fenced]


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
        SET status = 'pending', lease_owner = NULL, lease_token = NULL,
            lease_expires_at = NULL, attempts = greatest(i.attempts - 1, 0),
            updated_at = now()
        FROM r
        WHERE i.id = r.id AND i.lease_token = r.token AND i.status = 'leased'
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

"""Fenced completion: the outcomes of a set of attempts applied to their items in one
statement, only where the lease is still the attempt's, each deletion appended to the
evidence log as it is recorded, and every other attempt written to the audit trail.

An attempt that finished its item as `succeeded` has no `attempts` row: its item says when
its call started and ended, what the upstream answered and how many attempts it took
(`last_started_at`, `completed_at`, `last_status_code`, `attempts`), and the evidence log
records the deletion. The row and its foreign-key check were a quarter of a success's WAL
(bench/reports/design-notes.md, "Claims and completion"). Every attempt that did not
finish its item as succeeded, and every fenced one, has its row.

A worker whose lease expired and was claimed again elsewhere changes nothing: its attempt
is recorded as fenced. Times come from the database's clock. The measurements behind the
rules stated here are in bench/reports/design-notes.md ("Claims and completion").
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from service.db.statements import Database, Statement, fetch_records
from service.evidence.deletion_records import canonical_sql
from service.ledger.claims import Lease
from service.values import value


@value
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
#  4. every attempt but those that finished their item as `succeeded` is appended to the
#     audit trail, fenced ones flagged as such.
_COMPLETE = Statement("completions.complete", (
    "Apply attempts' outcomes to items still leased under the same token, append each "
    "deletion to the evidence log chained, and append every attempt that did not succeed "
    "to the audit trail, fenced ones flagged."), f"""
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
            last_started_at = d.started_at,
            last_error = CASE WHEN d.outcome = 'succeeded' THEN NULL ELSE d.reason END,
            dead_reason = CASE WHEN d.status = 'dead' THEN d.reason END,
            completed_at = CASE WHEN d.status IN ('succeeded', 'dead', 'skipped') THEN now()
                           END,
            object_version = coalesce(d.object_version, i.object_version),
            confirming = d.to_confirm,
            updated_at = now()
        FROM done d
        -- the token alone fences: only leased items carry one (CHECK items_lease), and
        -- without a status filter the planner keeps to primary-key lookups
        WHERE i.id = d.id AND i.lease_token = d.token
        RETURNING i.id, i.status, i.tenant_id, i.object_id, i.policy, i.policy_version,
                  i.operation_key, i.last_outcome, i.last_status_code, i.attempts,
                  i.completed_at, i.batch_id, d.confirmed, d.token
    ),
    deleted AS (
        SELECT a.id AS item_id, b.run_id,
               CASE WHEN a.batch_id IS NULL THEN 'webhook' ELSE 'run' END AS released_by,
               a.tenant_id, a.object_id, a.policy, a.policy_version, a.operation_key,
               a.last_outcome AS outcome, a.last_status_code AS upstream_status, a.attempts,
               a.completed_at, a.confirmed,
               CAST(:region AS text) AS region  -- where it was processed: the worker's
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
           a.id IS NULL
    FROM done d LEFT JOIN applied a ON a.id = d.id AND a.token = d.token
    WHERE a.status IS DISTINCT FROM 'succeeded'
    RETURNING item_id, fenced
""")  # noqa: S608 - only constant fragments are interpolated


async def complete(db: Database, completions: Sequence[Completion], *,
                   region: str | None = None) -> list[int]:
    """Apply outcomes and append the attempts that did not succeed in one statement;
    returns the ids that were fenced out (their lease had moved on). The evidence of each
    deletion names `region`, the completing worker's (None: it has none)."""
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
        "region": region,
    }
    rows = await fetch_records(db, _COMPLETE, params)
    return [r["item_id"] for r in rows if r["fenced"]]

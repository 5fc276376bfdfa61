"""The ledger: items, runs, batches, attempts, scopes, webhook receipts, operator actions.

Invariants live in the database, not only in Python: uniqueness of an obligation, the
status machine's column rules, bounded identifiers, one receipt per webhook id. The partial
indexes cover only rows a worker or a run can still act on, so the cost of claiming and
publishing does not grow with finished history.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

import re

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# Identifiers: 1..512 bytes, no control characters (they end up in URLs and logs).
_IDENT = "octet_length({c}) BETWEEN 1 AND 512 AND {c} !~ '[[:cntrl:]]'"
_OUTCOMES = "'succeeded', 'throttled', 'transient', 'unknown', 'permanent', 'unauthorized'"

UPGRADE = f"""
-- One token bucket per limiter scope, shared by every worker of every replica.
CREATE TABLE scopes (
    name             text PRIMARY KEY CHECK ({_IDENT.format(c="name")}),
    rate_per_second  double precision NOT NULL CHECK (rate_per_second > 0),
    burst            integer NOT NULL CHECK (burst >= 1),
    tokens           double precision NOT NULL CHECK (tokens >= 0 AND tokens <= burst),
    refilled_at      timestamptz NOT NULL DEFAULT now(),
    closed_until     timestamptz,
    backoff_level    integer NOT NULL DEFAULT 0 CHECK (backoff_level >= 0),
    paused           boolean NOT NULL DEFAULT false,
    paused_reason    text,
    weight           integer NOT NULL DEFAULT 1 CHECK (weight BETWEEN 1 AND 1000),
    -- false once an operator set the budget by hand: policy reloads no longer overwrite it
    budget_from_policy boolean NOT NULL DEFAULT true,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT scopes_pause_reason CHECK (paused = (paused_reason IS NOT NULL))
);

-- One row per cron trigger (or operator request).
CREATE TABLE runs (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    trigger_key      text UNIQUE CHECK (trigger_key IS NULL OR {_IDENT.format(c="trigger_key")}),
    request_digest   text NOT NULL,
    policy           text,
    tenant_id        text,
    cutoff           timestamptz NOT NULL,
    dry_run          boolean NOT NULL DEFAULT false,
    max_items        bigint CHECK (max_items > 0),
    state            text NOT NULL DEFAULT 'publishing'
                     CHECK (state IN ('publishing', 'published', 'failed')),
    candidates       bigint NOT NULL DEFAULT 0 CHECK (candidates >= 0),
    released         bigint NOT NULL DEFAULT 0 CHECK (released >= 0),
    batches          integer NOT NULL DEFAULT 0 CHECK (batches >= 0),
    remaining        bigint NOT NULL DEFAULT 0 CHECK (remaining >= 0),
    oldest_due_at    timestamptz,
    newest_due_at    timestamptz,
    report           jsonb NOT NULL DEFAULT '{{}}'::jsonb,
    error            text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    published_at     timestamptz,
    CONSTRAINT runs_published_at CHECK ((state = 'published') = (published_at IS NOT NULL))
);
CREATE INDEX runs_publishing ON runs (id) WHERE state = 'publishing';

-- A bounded group of released items; its digest is its durable identity.
CREATE TABLE batches (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id           bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    seq              integer NOT NULL CHECK (seq >= 0),
    digest           text NOT NULL UNIQUE CHECK (digest ~ '^[0-9a-f]{{64}}$'),
    policy           text NOT NULL,
    policy_version   integer NOT NULL CHECK (policy_version >= 1),
    item_count       integer NOT NULL CHECK (item_count > 0),
    created_at       timestamptz NOT NULL DEFAULT now(),
    UNIQUE (run_id, seq)
);

-- One row per intended cleanup. No customer payload: identifiers and outcomes only.
CREATE TABLE items (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id        text NOT NULL CHECK ({_IDENT.format(c="tenant_id")}),
    object_id        text NOT NULL CHECK ({_IDENT.format(c="object_id")}),
    policy           text NOT NULL CHECK (policy ~ '^[a-z0-9][a-z0-9_.-]{{0,62}}$'),
    policy_version   integer NOT NULL CHECK (policy_version >= 1),
    operation_key    text NOT NULL UNIQUE CHECK (operation_key ~ '^[0-9a-f]{{64}}$'),
    scope            text NOT NULL CHECK ({_IDENT.format(c="scope")}),
    status           text NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'leased', 'succeeded', 'dead', 'cancelled')),
    due_at           timestamptz NOT NULL,
    next_attempt_at  timestamptz NOT NULL DEFAULT '-infinity',
    attempts         integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    released_at      timestamptz,
    batch_id         bigint REFERENCES batches (id) ON DELETE SET NULL,
    lease_owner      text,
    lease_token      uuid,
    lease_expires_at timestamptz,
    last_outcome     text CHECK (last_outcome IN ({_OUTCOMES})),
    last_status_code smallint CHECK (last_status_code BETWEEN 100 AND 599),
    last_error       text,
    dead_reason      text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz,
    CONSTRAINT items_obligation UNIQUE (tenant_id, object_id, policy, policy_version),
    -- a lease is complete or absent, and only leased rows carry one
    CONSTRAINT items_lease CHECK (CASE WHEN status = 'leased'
        THEN lease_owner IS NOT NULL AND lease_token IS NOT NULL AND lease_expires_at IS NOT NULL
        ELSE lease_owner IS NULL AND lease_token IS NULL AND lease_expires_at IS NULL END),
    CONSTRAINT items_dead_reason CHECK ((status = 'dead') = (dead_reason IS NOT NULL)),
    CONSTRAINT items_completed_at CHECK (
        (status IN ('succeeded', 'dead', 'cancelled')) = (completed_at IS NOT NULL)),
    -- a worker only ever sees released items
    CONSTRAINT items_leased_released CHECK (status <> 'leased' OR released_at IS NOT NULL)
);
-- Claimable rows only: released pending items in batch order (webhook releases, which
-- have no batch, first), and live leases (whose expiry makes them claimable again).
-- Finished history is in neither index.
CREATE INDEX items_ready ON items (batch_id NULLS FIRST, id)
    WHERE status = 'pending' AND released_at IS NOT NULL;
CREATE INDEX items_leased ON items (lease_expires_at) WHERE status = 'leased';
-- Publication: pending items not yet released, by policy and age.
CREATE INDEX items_unreleased ON items (policy, due_at)
    WHERE status = 'pending' AND released_at IS NULL;
-- Run status and evidence walk a run's batches.
CREATE INDEX items_batch ON items (batch_id, status) WHERE batch_id IS NOT NULL;
CREATE INDEX items_dead ON items (policy, id) WHERE status = 'dead';

-- Append-only audit: one row per upstream call. No request or response bodies.
CREATE TABLE attempts (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    item_id             bigint NOT NULL REFERENCES items (id) ON DELETE CASCADE,
    attempt_no          integer NOT NULL CHECK (attempt_no >= 1),
    worker              text NOT NULL,
    lease_token         uuid NOT NULL,
    started_at          timestamptz NOT NULL,
    finished_at         timestamptz NOT NULL,
    outcome             text NOT NULL CHECK (outcome IN ({_OUTCOMES})),
    http_status         smallint CHECK (http_status BETWEEN 100 AND 599),
    retry_after_seconds double precision CHECK (retry_after_seconds >= 0),
    latency_ms          double precision NOT NULL CHECK (latency_ms >= 0),
    error_code          text,
    -- true when the lease had moved on: the attempt is kept, the item was not changed
    fenced              boolean NOT NULL DEFAULT false,
    CONSTRAINT attempts_finished_after_start CHECK (finished_at >= started_at)
);
CREATE INDEX attempts_item ON attempts (item_id, attempt_no);

-- De-duplication and attribution of storefront hints.
CREATE TABLE webhook_receipts (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source       text NOT NULL,
    webhook_id   text NOT NULL CHECK ({_IDENT.format(c="webhook_id")}),
    event_type   text,
    result       text NOT NULL CHECK (result IN ('applied', 'ignored')),
    item_ids     bigint[] NOT NULL DEFAULT '{{}}',
    received_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT webhook_receipts_once UNIQUE (source, webhook_id)
);

-- Who did what by hand: re-drives, cancellations, pauses, budget changes.
CREATE TABLE operator_actions (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at       timestamptz NOT NULL DEFAULT now(),
    actor    text NOT NULL,
    action   text NOT NULL,
    reason   text,
    details  jsonb NOT NULL DEFAULT '{{}}'::jsonb
);

-- Process-wide switches every replica reads; exactly one row.
CREATE TABLE control (
    singleton      boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    workers_paused boolean NOT NULL DEFAULT false,
    paused_reason  text,
    updated_at     timestamptz NOT NULL DEFAULT now()
);
INSERT INTO control DEFAULT VALUES;
"""

DOWNGRADE = """
DROP TABLE control;
DROP TABLE operator_actions;
DROP TABLE webhook_receipts;
DROP TABLE attempts;
DROP TABLE items;
DROP TABLE batches;
DROP TABLE runs;
DROP TABLE scopes;
"""


def _run(script: str) -> None:
    # One statement per call (asyncpg prepares each); exec_driver_sql keeps SQLAlchemy from
    # reading POSIX classes such as [[:cntrl:]] as bind parameters.
    bind = op.get_bind()
    for statement in re.split(r";\s*\n", script):
        if statement.strip():
            bind.exec_driver_sql(statement)


def upgrade() -> None:
    _run(UPGRADE)


def downgrade() -> None:
    _run(DOWNGRADE)

"""The ledger's minutes: what happened each minute, for the console's charts, without a
Prometheus (service/history/).

- `policy_minutes`: per minute and policy, outcomes committed, dead items, late (fenced)
  completions, expired leases taken over and scope closures, counted by the processes that
  made the calls; and the backlog (eligible items, age of the oldest), sampled by the leader.
- `scope_minutes`: per minute, scope and policy, calls made, successes, 429s, closures and
  expired leases taken over: each scope's budget use.
- `batch_minutes`: per minute and batch, its items finished (succeeded, dead, skipped): a
  run's progress over time, summed over its batches.

Counts are added by upserts (one row per key, however many processes add to it) and pruned
by retention. Locks: new tables only.

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-05
"""

from alembic import op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE TABLE policy_minutes (
            policy text NOT NULL,
            minute timestamptz NOT NULL CHECK (date_trunc('minute', minute) = minute),
            succeeded integer NOT NULL DEFAULT 0,
            throttled integer NOT NULL DEFAULT 0,
            transient integer NOT NULL DEFAULT 0,
            unknown integer NOT NULL DEFAULT 0,
            permanent integer NOT NULL DEFAULT 0,
            unauthorized integer NOT NULL DEFAULT 0,
            skipped integer NOT NULL DEFAULT 0,
            dead integer NOT NULL DEFAULT 0,
            fenced integer NOT NULL DEFAULT 0,
            reclaimed integer NOT NULL DEFAULT 0,
            closures integer NOT NULL DEFAULT 0,
            eligible integer,
            oldest_eligible_s double precision,
            PRIMARY KEY (minute, policy)
        )""")
    op.execute("""
        CREATE TABLE scope_minutes (
            scope text NOT NULL,
            minute timestamptz NOT NULL CHECK (date_trunc('minute', minute) = minute),
            policy text NOT NULL,
            calls integer NOT NULL DEFAULT 0,
            succeeded integer NOT NULL DEFAULT 0,
            throttled integer NOT NULL DEFAULT 0,
            closures integer NOT NULL DEFAULT 0,
            reclaimed integer NOT NULL DEFAULT 0,
            PRIMARY KEY (scope, minute, policy)
        )""")
    # pruning walks minutes in order: the primary key leads with the scope
    op.execute("CREATE INDEX scope_minutes_minute ON scope_minutes (minute)")
    op.execute("""
        CREATE TABLE batch_minutes (
            batch_id bigint NOT NULL REFERENCES batches (id) ON DELETE CASCADE,
            minute timestamptz NOT NULL CHECK (date_trunc('minute', minute) = minute),
            succeeded integer NOT NULL DEFAULT 0,
            dead integer NOT NULL DEFAULT 0,
            skipped integer NOT NULL DEFAULT 0,
            PRIMARY KEY (batch_id, minute)
        )""")
    op.execute("CREATE INDEX batch_minutes_minute ON batch_minutes (minute)")


def downgrade() -> None:
    op.execute("DROP TABLE batch_minutes")
    op.execute("DROP TABLE scope_minutes")
    op.execute("DROP TABLE policy_minutes")

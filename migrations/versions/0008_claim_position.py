"""Claims read `items_ready` from each scope's claim position, not from the index's front.

A claim takes its items out of the partial index `items_ready`, but their entries stay in
the index until VACUUM removes them, and they sit at its front: claims go in batch order.
Every claim that read from the front walked all the entries left by the items claimed
before it. Draining a backlog of 1,000,000 items with autovacuum off, each scan of the
index read 2,368 pages at the end, and the last tenth drained at 0.44 of the first
tenth's pace (0.74 with autovacuum on at PostgreSQL's defaults).

- `scopes.ready_after_batch`, `ready_after_id`: the last item, in index order, that the
  scope's last claim took. The next claim reads the index after it, past the entries that
  claims left behind. (0, 0) means the front: webhook releases (no batch), then every
  batch.
- `scopes.front_scanned_at`: when a claim last read the scope from the front. Items come
  back behind the position (retries, hand-backs, webhook releases, a batch whose
  publication committed after a later one), so a claim reads from the front again once a
  second, or as soon as a claim finds fewer items past the position than it had tokens.
  Expired leases are looked for on those front reads only: `items_leased` has the same
  walk (its entries of finished leases stay at its front), and a lease expires after tens
  of seconds, so a second more before it is taken over changes little.
- The index orders by `coalesce(batch_id, 0)`: with webhook releases keyed 0 instead of
  NULL, "after (batch, id)" is one row comparison on the index for every position, the
  front too. Batch and item ids start at 1.

Rebuilding the index reads the items table once, under a lock that blocks writes to it;
on a very large ledger run this migration in a quiet moment.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE scopes ADD COLUMN ready_after_batch bigint NOT NULL DEFAULT 0,"
               " ADD COLUMN ready_after_id bigint NOT NULL DEFAULT 0,"
               " ADD COLUMN front_scanned_at timestamptz")
    op.execute("DROP INDEX items_ready")
    op.execute("CREATE INDEX items_ready ON items (scope, (coalesce(batch_id, 0)), id) "
               "WHERE status = 'pending' AND released_at IS NOT NULL")


def downgrade() -> None:
    op.execute("DROP INDEX items_ready")
    op.execute("CREATE INDEX items_ready ON items (scope, batch_id NULLS FIRST, id) "
               "WHERE status = 'pending' AND released_at IS NOT NULL")
    op.execute("ALTER TABLE scopes DROP COLUMN ready_after_batch, DROP COLUMN ready_after_id,"
               " DROP COLUMN front_scanned_at")

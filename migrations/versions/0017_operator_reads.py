"""Indexes for what operators read (bench/reports/2026-12-02-console, a million items):

- `items_pending`, pending items by id: lists of pending items (`status=pending`, by id,
  optionally of one policy or tenant; the console's and `GET /v1/items`') read it instead
  of walking the primary key past every finished row (about 140 ms a page). Like
  `items_dead` it holds only rows in that status: a registration or a retry adds an entry,
  a lease or a completion none.
- `items_batch_cover` replaces `items_batch`: the same key, with the item's id and hold
  included, so a run's progress (`runs.progress`: its items by status) reads the index
  alone instead of every item of the ledger (a run of 50,000 items: 252 ms to 58 ms; the
  overview's recent runs 116 ms to 27 ms). It is written when `items_batch` was.

On a ledger that is already large, create them by hand first, without blocking writes
(`CREATE INDEX CONCURRENTLY IF NOT EXISTS ...` as below, then `DROP INDEX CONCURRENTLY
items_batch`); this migration then finds them and skips them.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-02
"""

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("CREATE INDEX IF NOT EXISTS items_pending ON items (id) "
               "WHERE status = 'pending'")
    op.execute("CREATE INDEX IF NOT EXISTS items_batch_cover ON items (batch_id, status) "
               "INCLUDE (id, hold_id) WHERE batch_id IS NOT NULL")
    op.execute("DROP INDEX IF EXISTS items_batch")


def downgrade() -> None:
    op.execute("CREATE INDEX IF NOT EXISTS items_batch ON items (batch_id, status) "
               "WHERE batch_id IS NOT NULL")
    op.execute("DROP INDEX items_batch_cover")
    op.execute("DROP INDEX items_pending")

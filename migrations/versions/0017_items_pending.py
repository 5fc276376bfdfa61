"""Pending items by id: the console's and `GET /v1/items`' lists of pending items
(`status=pending`, by id, optionally of one policy or tenant) read them here instead of
walking the primary key past every finished row (about 140 ms a page with a million finished
items; bench/reports/2026-12-02-console). Like `items_dead`, it holds only rows in that
status: a registration or a retry adds an entry, a lease or a completion none.

On a ledger that is already large, create it by hand first, without blocking writes
(`CREATE INDEX CONCURRENTLY IF NOT EXISTS items_pending ...` as below); this migration then
finds it and skips it.

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


def downgrade() -> None:
    op.execute("DROP INDEX items_pending")

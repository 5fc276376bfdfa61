"""Retention: finished items and webhook receipts are pruned by age, so each needs an index
on its age. The items index covers finished rows only; claims never read it.

On a ledger that is already large, create the index by hand first, without blocking writes
(`CREATE INDEX CONCURRENTLY IF NOT EXISTS items_finished ...` as below); this migration then
finds it and skips it.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("CREATE INDEX IF NOT EXISTS items_finished ON items (completed_at) "
               "WHERE status IN ('succeeded', 'cancelled')")
    op.execute("CREATE INDEX IF NOT EXISTS webhook_receipts_received "
               "ON webhook_receipts (received_at)")


def downgrade() -> None:
    op.execute("DROP INDEX webhook_receipts_received")
    op.execute("DROP INDEX items_finished")

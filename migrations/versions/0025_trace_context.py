"""Trace context in the ledger: the W3C `traceparent` of the request that triggered a run
(`runs.trace_parent`) and of the batch or webhook delivery that released an item
(`items.trace_parent`), so an item's claims, calls and completions join that trace on
whichever replica makes them (service/observability/tracing.py). NULL while tracing is off.

Locks: nullable columns without a default, added without rewriting either table.

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-05
"""

from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE runs ADD COLUMN trace_parent text")
    op.execute("ALTER TABLE items ADD COLUMN trace_parent text")


def downgrade() -> None:
    op.execute("ALTER TABLE items DROP COLUMN trace_parent")
    op.execute("ALTER TABLE runs DROP COLUMN trace_parent")

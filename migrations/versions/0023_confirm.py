"""Confirmation reads: an item whose deletion answered success and waits for a read that
finds its object absent (`confirming`), claimed again like any pending item.

A constant default: PostgreSQL 11+ adds the column without rewriting `items`.

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-05
"""

from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE items ADD COLUMN confirming boolean NOT NULL DEFAULT false")


def downgrade() -> None:
    op.execute("ALTER TABLE items DROP COLUMN confirming")

"""Scopes know how many objects one call of theirs carries.

A policy with `batch = { max_objects = N }` sends up to N objects of one scope per call, and
a scope's tokens count calls: a claim may take N items per token. The admission statement
reads it from the scope's row, as it reads the rate and the burst; registration keeps it
equal to the policy's (1 for one object per call).

A NOT NULL column with a constant default is a catalog change (PostgreSQL 11+): no rewrite.
The CHECK scans scopes, a table of one row per scope.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE scopes ADD COLUMN objects_per_call integer NOT NULL DEFAULT 1 "
               "CONSTRAINT scopes_objects_per_call CHECK (objects_per_call BETWEEN 1 AND 1000)")


def downgrade() -> None:
    op.execute("ALTER TABLE scopes DROP COLUMN objects_per_call")

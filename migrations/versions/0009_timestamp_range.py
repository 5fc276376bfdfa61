"""Items' due times and runs' cutoffs lie in the range the API accepts.

The API now refuses timestamps outside 1970-01-01T00:00:00Z .. 9999-12-31T00:00:00Z
(service/http/api/bodies.py). Before, a due_at such as 0001-01-01T00:00:00+14:00 was stored
as a BC time that Python cannot represent, and every read of it failed. This migration
moves any such value to the nearest end of the range, which keeps what it meant (a
past due time is due now; a time past year 9999 is never reached), and adds CHECK
constraints so no path can store one again.

Each table is read once to repair and once to validate (validation does not block
writes).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

# Repair first, then constrain; NOT VALID + VALIDATE does not block writes while it reads.
UPGRADE = (
    "UPDATE items SET due_at = greatest(least(due_at, '9999-12-31 00:00:00+00'),"
    " '1970-01-01 00:00:00+00') "
    "WHERE due_at < '1970-01-01 00:00:00+00' OR due_at > '9999-12-31 00:00:00+00'",
    "ALTER TABLE items ADD CONSTRAINT items_due_at_range "
    "CHECK (due_at BETWEEN '1970-01-01 00:00:00+00' AND '9999-12-31 00:00:00+00') NOT VALID",
    "ALTER TABLE items VALIDATE CONSTRAINT items_due_at_range",
    "UPDATE runs SET cutoff = greatest(least(cutoff, '9999-12-31 00:00:00+00'),"
    " '1970-01-01 00:00:00+00') "
    "WHERE cutoff < '1970-01-01 00:00:00+00' OR cutoff > '9999-12-31 00:00:00+00'",
    "ALTER TABLE runs ADD CONSTRAINT runs_cutoff_range "
    "CHECK (cutoff BETWEEN '1970-01-01 00:00:00+00' AND '9999-12-31 00:00:00+00') NOT VALID",
    "ALTER TABLE runs VALIDATE CONSTRAINT runs_cutoff_range",
)


def upgrade() -> None:
    for statement in UPGRADE:
        op.execute(statement)


def downgrade() -> None:
    op.execute("ALTER TABLE items DROP CONSTRAINT items_due_at_range")
    op.execute("ALTER TABLE runs DROP CONSTRAINT runs_cutoff_range")

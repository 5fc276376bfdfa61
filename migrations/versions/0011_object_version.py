"""Items carry the object version an optimistic-concurrency conflict named.

An upstream such as commercetools deletes `?version=N` only when N is the object's current
version, and answers a stale one with 409 and the current version. The policy's answer rule
(service/answers.py) reads it, and the item's next call carries it as {object_version}.
NULL: none named yet (the policy's initial_object_version is sent).

A new nullable column with no default is a catalog change; the CHECK is added NOT VALID
and validated separately, so no write waits for the scan.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

UPGRADE = (
    "ALTER TABLE items ADD COLUMN object_version text",
    "ALTER TABLE items ADD CONSTRAINT items_object_version "
    "CHECK (object_version ~ '^[A-Za-z0-9_.:-]{1,64}$') NOT VALID",
    "ALTER TABLE items VALIDATE CONSTRAINT items_object_version",
)


def upgrade() -> None:
    for statement in UPGRADE:
        op.execute(statement)


def downgrade() -> None:
    op.execute("ALTER TABLE items DROP COLUMN object_version")

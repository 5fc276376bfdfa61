"""Items carry the object version an optimistic-concurrency conflict named.

An upstream such as commercetools deletes `?version=N` only when N is the object's current
version, and answers a stale one with 409 and the current version. The policy's answer rule
(service/config/answer_rules.py) reads it, and the item's next call carries it as {object_version}.
NULL: none named yet (the policy's initial_object_version is sent).

A new nullable column with no default is a catalog change, made under a brief ACCESS
EXCLUSIVE lock. It has no CHECK: validating one scans the whole table, and inside the
migration's one transaction the scan would hold that lock (every reader and writer of
items would wait). What is stored is checked before it is written: short and code-like,
never `.` or `..` (answers.code_of and Rule.verdict), and a request template encodes it
as one path segment or query value whatever it holds.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE items ADD COLUMN object_version text")


def downgrade() -> None:
    op.execute("ALTER TABLE items DROP COLUMN object_version")

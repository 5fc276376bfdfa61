"""The operation key loses its own unique index: the obligation's unique index already
makes it unique.

`items.operation_key` is `ledger.operation_key(tenant_id, object_id, policy,
policy_version)`, a SHA-256 over exactly the obligation's columns, and registration and the
webhook intake are its only writers, so two rows can share a key only if they share an
obligation, which `items_obligation` forbids. The second index cost every write of an item
one more insert into a B-tree of random 64-character keys: a status change is never a HOT
update, so each release, claim and completion inserted into it again. Measured on 200,000
items: releasing a batch of 500 took 19.4 ms with it and 15.0 ms without.

Operator filters by item reference still compare `operation_key`, always together with a
status whose partial index narrows the rows first.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE items DROP CONSTRAINT IF EXISTS items_operation_key_key")


def downgrade() -> None:
    op.execute("ALTER TABLE items ADD CONSTRAINT items_operation_key_key UNIQUE (operation_key)")

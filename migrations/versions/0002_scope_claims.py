"""Claims go scope by scope (the shared rate budget admits work per scope): the ready index
leads with the scope, and expired leases are found per scope too. A bucket may lend a few
milliseconds of future tokens (reservations, so the budget is used to the full instead of
losing every refill that arrives while no worker is looking): tokens may go below zero.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE scopes DROP CONSTRAINT scopes_check")
    op.execute("ALTER TABLE scopes ADD CONSTRAINT scopes_tokens CHECK (tokens <= burst)")
    # Released pending items of one scope in batch order (webhook releases first): the
    # per-scope claim and the "does this scope have work" probe both walk this index.
    op.execute("DROP INDEX items_ready")
    op.execute("CREATE INDEX items_ready ON items (scope, batch_id NULLS FIRST, id) "
               "WHERE status = 'pending' AND released_at IS NOT NULL")
    op.execute("DROP INDEX items_leased")
    op.execute("CREATE INDEX items_leased ON items (scope, lease_expires_at) "
               "WHERE status = 'leased'")


def downgrade() -> None:
    op.execute("ALTER TABLE scopes DROP CONSTRAINT scopes_tokens")
    op.execute("UPDATE scopes SET tokens = greatest(tokens, 0)")
    op.execute("ALTER TABLE scopes ADD CONSTRAINT scopes_check "
               "CHECK (tokens >= 0 AND tokens <= burst)")
    op.execute("DROP INDEX items_leased")
    op.execute("CREATE INDEX items_leased ON items (lease_expires_at) WHERE status = 'leased'")
    op.execute("DROP INDEX items_ready")
    op.execute("CREATE INDEX items_ready ON items (batch_id NULLS FIRST, id) "
               "WHERE status = 'pending' AND released_at IS NOT NULL")

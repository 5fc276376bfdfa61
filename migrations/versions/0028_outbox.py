"""The broker's outbox: batches, webhook deliveries that released items, released legal
holds and operators' re-drives (`requeues`, a new table), not yet handed to a broker. With SWEEPER_EXECUTION=rabbitmq the leader's relay publishes each one's pending
items once it is committed here and marks it `enqueued_at` once the broker confirmed it
(service/execution/relay.py); a released hold hands over its tenant's items it may have
kept waiting. In database mode nothing reads the column (the ledger is the
queue), so a ledger moved to broker mode hands over what database mode released and left
unfinished, and nothing is lost in the switch.

Locks: ACCESS EXCLUSIVE on batches, webhook_receipts and holds for a moment (a nullable column, no
rewrite); each index then takes a SHARE lock while it scans its table. On a large ledger
create them by hand first (`CREATE INDEX CONCURRENTLY IF NOT EXISTS ...` as below); this
migration then skips them.

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-05
"""

from alembic import op

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("batches", "webhook_receipts"):
        op.execute(f"ALTER TABLE {table} ADD COLUMN enqueued_at timestamptz")
        op.execute(f"CREATE INDEX IF NOT EXISTS {table}_to_enqueue ON {table} (id) "
                   "WHERE enqueued_at IS NULL")
    op.execute("""
        CREATE TABLE requeues (
            id bigserial PRIMARY KEY,
            item_ids bigint[] NOT NULL,
            created_at timestamptz NOT NULL DEFAULT now(),
            enqueued_at timestamptz
        )""")
    op.execute("CREATE INDEX requeues_to_enqueue ON requeues (id) WHERE enqueued_at IS NULL")
    op.execute("ALTER TABLE holds ADD COLUMN enqueued_at timestamptz")
    op.execute("CREATE INDEX IF NOT EXISTS holds_to_enqueue ON holds (id) "
               "WHERE released_at IS NOT NULL AND enqueued_at IS NULL")


def downgrade() -> None:
    op.execute("DROP TABLE requeues")
    op.execute("DROP INDEX IF EXISTS holds_to_enqueue")
    op.execute("ALTER TABLE holds DROP COLUMN enqueued_at")
    for table in ("batches", "webhook_receipts"):
        op.execute(f"DROP INDEX IF EXISTS {table}_to_enqueue")
        op.execute(f"ALTER TABLE {table} DROP COLUMN enqueued_at")

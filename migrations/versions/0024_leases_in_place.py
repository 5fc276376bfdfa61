"""Leases in place: a claim writes only columns no index reads, so it can be a HOT update;
and a success is recorded on its item, without an attempt row.

A leased item keeps `status = 'pending'`; its lease is its `lease_token`, `lease_owner` and
`lease_expires_at` (all set or all NULL). `status` is read by most of `items`' indexes
(their keys or WHERE clauses) and `lease_expires_at` by `items_leased`, so a claim that
changed either wrote a new entry in every index the row is in. Without them, and with room
left on each page (fillfactor 80; pages written before keep theirs), the claim's new row
version stays on its page with no index entry, and a retry's completion too: a success is
the item's one non-HOT update after its release. Expired leases are found by the claim's
walk of `items_ready`, which holds leased items too now (bench/reports/design-notes.md,
"Claims and completion").

`last_started_at`: when the item's last attempt's call started, written by every
completion. A success has no `attempts` row any more (service/ledger/completions.py): this,
`completed_at`, `last_status_code` and `attempts` say what the row said. A nullable column
without a default: added without rewriting `items`.

Locks: no scan of `items` under its ACCESS EXCLUSIVE lock. The UPDATE reads the items
leased when it runs through `items_leased` (at most the calls in flight), and the new
checks are added NOT VALID: they hold for every row written from now on, and the rows
before satisfy them once that UPDATE has run. On a large ledger, validate them later
without blocking writes: `ALTER TABLE items VALIDATE CONSTRAINT items_lease` (and
`items_status_check`). Stop the workers of the previous version before migrating: they
write `status = 'leased'`, which the new check refuses.

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-05
"""

from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE items DROP CONSTRAINT items_lease, "
               "DROP CONSTRAINT items_leased_released, DROP CONSTRAINT items_status_check")
    op.execute("UPDATE items SET status = 'pending' WHERE status = 'leased'")
    op.execute("""
        ALTER TABLE items
        ADD CONSTRAINT items_status_check
            CHECK (status IN ('pending', 'succeeded', 'dead', 'cancelled', 'skipped'))
            NOT VALID,
        -- a lease is all three columns or none, on a released pending item only
        ADD CONSTRAINT items_lease
            CHECK ((lease_token IS NULL) = (lease_owner IS NULL)
                   AND (lease_token IS NULL) = (lease_expires_at IS NULL)
                   AND (lease_token IS NULL
                        OR (status = 'pending' AND released_at IS NOT NULL)))
            NOT VALID""")
    op.execute("DROP INDEX items_leased")
    op.execute("ALTER TABLE items SET (fillfactor = 80)")
    op.execute("ALTER TABLE items ADD COLUMN last_started_at timestamptz")


def downgrade() -> None:
    op.execute("ALTER TABLE items DROP COLUMN last_started_at")
    op.execute("ALTER TABLE items RESET (fillfactor)")
    op.execute("ALTER TABLE items DROP CONSTRAINT items_lease, "
               "DROP CONSTRAINT items_status_check")
    op.execute("UPDATE items SET status = 'leased' WHERE lease_token IS NOT NULL")
    op.execute("""
        ALTER TABLE items
        ADD CONSTRAINT items_status_check CHECK (status IN ('pending', 'leased', 'succeeded',
                                                            'dead', 'cancelled', 'skipped')),
        ADD CONSTRAINT items_lease CHECK (CASE WHEN status = 'leased'
            THEN lease_owner IS NOT NULL AND lease_token IS NOT NULL
                 AND lease_expires_at IS NOT NULL
            ELSE lease_owner IS NULL AND lease_token IS NULL AND lease_expires_at IS NULL END),
        ADD CONSTRAINT items_leased_released
            CHECK (status <> 'leased' OR released_at IS NOT NULL)""")
    op.execute("CREATE INDEX items_leased ON items (scope, lease_expires_at) "
               "WHERE status = 'leased'")
